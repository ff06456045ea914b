"""Where the two sides of ``bench peers`` still differ, and why: both jobs (:data:`DIFFERENCES`)
and the multi-turn job's tool loop (:data:`TRL_TOOLS_DIFFERENCES`). The results carry both
(``settings.differences*``) and docs/benchmarks.md shows them; everything else is the same."""

from __future__ import annotations

#: Where the two sides differ and why (the rest is the same; ``settings`` of each row records both).
DIFFERENCES: list[dict[str, str]] = [
    {"setting": "where a turn stops", "trl": "at the model's EOS (<|im_end|>, which the warm-up taught after every answer) "
     "or the completion budget", "treegrpo": "single-turn: right after </answer> (its stop string; the EOS the model "
     "would write next is not generated); multi-turn: at the end-of-turn token, as TRL",
     "why": "TRL 1.16's transformers path calls generate() without tokenizer=, which transformers needs for "
            "stop_strings (generation_kwargs={'stop_strings': ...} raises ValueError; probed per run: "
            "settings.probes.stop_strings); nothing is added on TRL's side. Each row records its completion lengths "
            "and a ratio is refused when the two sides' means differ by more than 1.3x."},
    {"setting": "prompt shared across the group", "trl": "each prompt is repeated G times in the batch: prefilled and "
     "trained G times", "treegrpo": "prefilled once per prompt (shared-prefix KV) and packed once in the update",
     "why": "what is measured: each side's own way of running the same job"},
    {"setting": "advantage epsilon", "trl": "(r - mean) / (std + 1e-4), std unbiased", "treegrpo": "(r - mean) / (std + 1e-6), "
     "std unbiased", "why": "each library's constant; equal when std = 0 (advantage 0) and within 1e-4 relative otherwise"},
    {"setting": "AdamW implementation", "trl": "optim=adamw_torch_fused (its default)", "treegrpo": "torch.optim.AdamW",
     "why": "the same update (betas 0.9/0.999, eps 1e-8, weight decay 0); each library's default kernel"},
    {"setting": "log-probs in the update", "trl": "its fused LM head (trl/trainer/utils.py add_fused_lm_head): off "
     "CUDA/XPU (no Triton) it scores every prompt and completion position, in chunks of 32768 positions (one chunk "
     "here: full-vocabulary logits of the whole batch at once); probed per run: settings.probes.lm_head",
     "treegrpo": "LM head + log-softmax over the policy positions, in chunks of 1024 positions",
     "why": "each library's own code, not a setting (GRPOConfig has no knob for either); the same values"},
    {"setting": "set on TRL to match (its defaults differ)", "trl": "lr_scheduler_type=constant, bf16=False, "
     "shuffle_dataset=False, beta=0, loss_type as LOSS_PAIRS, one optimizer step per generation batch",
     "treegrpo": "constant lr, float32, the seed's prompt order, kl_coef=0", "why": "the same job: TRL's defaults "
     "are linear lr decay, bf16 and a shuffled dataset"},
]  # fmt: skip

#: Where the multi-turn TRL row and treegrpo's multi-turn rows still differ, and why (on top of
#: :data:`DIFFERENCES`, which hold for both jobs).
TRL_TOOLS_DIFFERENCES: list[dict[str, str]] = [
    {"setting": "per-turn token cap",
     "trl": "none: each generate call of the tool loop may write up to max_completion_length new tokens, then the "
            "turn is cut to what is left of the completion budget; a turn cut before <|im_end|> is still parsed, "
            "and a complete <tool_call> in it runs (the results follow the cut turn)",
     "treegrpo": "max_step_tokens per turn; a turn cut there (no end-of-turn token) ends the trajectory, its "
                 "calls not run, scored as it stands",
     "why": "TRL's tool loop has no per-turn setting (max_completion_length bounds the whole multi-turn completion; "
            "GRPOConfig.generation_kwargs={'max_new_tokens': ...} would cap every generate call but is not set: the "
            "row runs TRL's tool loop as it is). A warmed-up model ends its turns at <|im_end|> by itself"},
    {"setting": "completion budget and context limit",
     "trl": "max_completion_length = max_context_tokens - the job's shortest prompt, on the completion alone "
            "(generated tokens + tool results); a tool round whose results would pass it is dropped and the "
            "trajectory ends with its last turn's calls unanswered; no other context limit below the model's "
            "max_position_embeddings",
     "treegrpo": "max_context_tokens on prompt + completion: a turn is generated only when a whole max_step_tokens "
                 "turn still fits, and a tool round after which none fits ends the trajectory (its results dropped)",
     "why": "every treegrpo trajectory's completion is <= max_context_tokens - its prompt <= the TRL budget, so TRL "
            "never stops first; TRL may go on where treegrpo stops (it keeps no room for a whole next turn, and a "
            "longer prompt leaves it up to (prompt - shortest prompt) tokens more). Recorded: settings.trl_tools"},
    {"setting": "tool rounds (max_turns)",
     "trl": "max_tool_calling_iterations = max_turns: up to max_turns rounds of running the calls and generating "
            "again; calls written in the turn after the last round are not run, the completion ends with them",
     "treegrpo": "max_turns turns may call tools, then one final turn in which a call is refused (not run), "
                 "ending the trajectory",
     "why": "the same count on both sides: at most max_turns tool rounds and max_turns + 1 assistant turns, the "
            "last one's calls unrun; a round with a failing call counts on both sides"},
    {"setting": "a malformed tool call",
     "trl": "a turn whose <tool_call> block does not parse (invalid JSON, no name) fails parse_response, which falls "
            "back to the turn's text decoded without special tokens: no calls, the trajectory ends with that text "
            "as its final answer",
     "treegrpo": "an invalid action: the bad call gets an 'Error: ...' tool result, the turn counts against "
                 "max_turns and the trajectory goes on",
     "why": "each library's own parsing (trl.chat_template_utils.parse_response; treegrpo.rollout.toolcall)"},
    {"setting": "a call that cannot run (unknown tool, arguments that do not fit)",
     "trl": "called as fn(**arguments); the exception's text comes back as str({'error': msg}); every attempted "
            "call is counted (tools/call_frequency)",
     "treegrpo": "arguments checked against the schema before the call; the result is 'Error: ...'; only calls "
                 "that ran are counted (budget/tool_calls)",
     "why": "each library's own; the search tool itself never raises with the in-process BM25 retriever, so only "
            "a wrong tool name or argument differs"},
    {"setting": "tool result length",
     "trl": "the tool's result text in full",
     "treegrpo": "each result cut to max_obs_tokens tokens (marked ' …')",
     "why": "TRL has no cap on a tool result; how often treegrpo's cap would have cut one in the TRL row is "
            "counted per step (tool_results_over_obs_cap; the default 600 fits topk=3 wiki-vital passages: p99 556 "
            "tokens with SmolLM2's tokenizer)"},
    {"setting": "prefill of later turns",
     "trl": "each tool round's generate call runs the whole context of every trajectory with a call again "
            "(prompt + earlier turns + results, left-padded to the longest): prefill_positions, padding included",
     "treegrpo": "its engine keeps each trajectory's KV between turns and a prompt's across its group (prefix "
                 "reuse): budget/prefill_tokens counts the non-pad positions it computed",
     "why": "what is measured: each side's own way of running the same job"},
    {"setting": "the messages the reward reads",
     "trl": "parse_response's assistant messages (content without the calls and the end-of-turn token) and "
            "{'role': 'tool', 'name', 'content'} results",
     "treegrpo": "its own parse of each turn (content without the calls, stripped) and the same tool messages",
     "why": "the same reward functions (env.rewards.score); the built-in rewards normalize whitespace, so the two "
            "parses score a turn alike; a cut or malformed turn differs as above"},
    {"setting": "end-of-turn ids",
     "trl": "generation_config.eos_token_id plus the tokenizer's EOS",
     "treegrpo": "the tokenizer's EOS plus <|im_end|> / <|eot_id|> / <|eom_id|> where they are single tokens",
     "why": "both {<|im_end|>} for SmolLM2 with chatml-tools; recorded per run: settings.trl_tools.stop_ids"},
    {"setting": "dr_grpo normalizer (loss seq-mean-token-sum-norm only)",
     "trl": "token sum / (sequences x max_completion_length), here the whole completion budget",
     "treegrpo": "token sum / (sequences x the longest path)",
     "why": "each library's constant; the bench's default loss (token-mean / dapo) has none"},
]  # fmt: skip

__all__ = ["DIFFERENCES", "TRL_TOOLS_DIFFERENCES"]
