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

tools = [calculator, lookup]
warm = f"runs/calc-warm-{args.protocol}"
treegrpo.warmup(args.model, demos="demos.jsonl", eval_data="eval.jsonl", tools=tools, reward_funcs=[reward],
                out=warm, protocol=args.protocol, epochs=2)
summary = treegrpo.train(warm, train_data="questions.jsonl", eval_data="eval.jsonl", tools=tools, reward_funcs=[reward],
                         protocol=args.protocol, sampler=args.sampler, steps=args.steps, prompts_per_step=4,
                         out_dir=f"runs/calc-{args.sampler}-{args.protocol}")
print(f"held-out reward {summary.eval_start['eval/success_sampled']:.3f} -> {summary.eval_end['eval/success_sampled']:.3f}")
