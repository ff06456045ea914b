"""treegrpo: RL for LLM agents with tree-search rollouts."""

__version__ = "0.1.0"
