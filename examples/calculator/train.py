"""Warm SmolLM2-135M up on the demonstrations, then train it with Tree-GRPO (docs/tools.md).

    cd examples/calculator && python train.py [--protocol tags|tools] [--model smollm2-135m] [--steps 10]
"""

import argparse

from tools import calculator, lookup, reward

import treegrpo

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="smollm2-135m")
parser.add_argument("--protocol", default="tags", help="tags | tools (the model's own tool calling)")
parser.add_argument("--sampler", default="tree")
parser.add_argument("--steps", type=int, default=10)
args = parser.parse_args()

tools, warm = [calculator, lookup], f"runs/calc-warm-{args.protocol}"
limits = {"max_turns": 3, "max_step_tokens": 64}  # two calls and an answer, each under 64 tokens
# the native protocol: SmolLM2's own template renders no tools, so give it the tool-capable ChatML one
native = {"protocol": "tools", "chat_template": "chatml-tools"} if args.protocol == "tools" else {}
treegrpo.warmup(args.model, demos="demos.jsonl", eval_data="eval.jsonl", tools=tools, reward_funcs=[reward],
                out=warm, epochs=2, **limits, **native)
summary = treegrpo.train(warm, train_data="questions.jsonl", eval_data="eval.jsonl", tools=tools, reward_funcs=[reward],
                         sampler=args.sampler, steps=args.steps, prompts_per_step=4,
                         threads=1,  # as benchmarks/results/calculator.json was made; leave it out to use every core
                         out_dir=f"runs/calc-{args.sampler}-{args.protocol}", **limits, **native)
print(f"held-out reward {summary.eval_start['eval/success_sampled']:.3f} -> {summary.eval_end['eval/success_sampled']:.3f}")
