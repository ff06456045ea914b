import random, statistics, threading, time, queue
import torch
from treegrpo.envs.base import Task
from treegrpo.envs.search import SearchEnv
from treegrpo.models.loader import load_tokenizer, load_model
from treegrpo.retrieval.base import Doc
from treegrpo.retrieval.bm25 import BM25Retriever
from treegrpo.rollout.agent import AgentConfig, StepRunner
from treegrpo.rollout.engine import make_engine
from treegrpo.rollout.samplers import SamplerConfig, sample_trees
from treegrpo.rollout.pipeline import chain_latency

import math
class Lat:
    def __init__(self, inner, lat, heavy=False): self.inner, self.lat, self.heavy, self.rng = inner, lat, heavy, random.Random(0)
    def __getattr__(self, n): return getattr(self.inner, n)
    def step_stream(self, tasks, steps, allowed, **kw):
        q = queue.SimpleQueue()
        lats = [self.rng.lognormvariate(math.log(self.lat), 0.99) if self.heavy else self.lat for _ in steps]
        def one(i):
            time.sleep(lats[i])
            (o,) = self.inner.step([tasks[i]], [steps[i]], [allowed[i]])
            o.info = {**o.info, "tool_latency_s": [lats[i]]}
            q.put((i, o))
        for i in range(len(steps)): threading.Thread(target=one, args=(i,), daemon=True).start()
        for _ in steps: yield q.get()
    def step(self, tasks, steps, allowed, **kw):
        d = dict(self.step_stream(tasks, steps, allowed)); return [d[i] for i in range(len(steps))]

def test_bench(tiny_model_dir):
    torch.set_num_threads(1)
    tok = load_tokenizer(tiny_model_dir); model = load_model(tiny_model_dir)
    docs = [Doc(str(i), f"city{i}\ncity{i} is in country{i%3}.") for i in range(6)]
    base = SearchEnv(BM25Retriever(docs), topk=1, prompt_template="minimal")
    tasks = [Task(f"q{i}", f"where is city{i}?", ["x"]) for i in range(8)]
    cfg = SamplerConfig("tree", m=2, n=2, l=1)
    def run(env, **flags):
        walls, chains = [], []
        for rep in range(3):
            r = StepRunner(make_engine("hf", model, tok), env, tok, AgentConfig(max_turns=3, max_step_tokens=16, **flags))
            t = time.perf_counter(); res = sample_trees(r, tasks, cfg, random.Random(rep), torch.Generator().manual_seed(rep))
            walls.append(time.perf_counter() - t); chains.append(chain_latency(res.forests))
        return statistics.median(walls), statistics.median(chains), res.engine_calls
    import treegrpo.rollout.pipeline as P, os
    P.QUIET_FRACTION = float(os.environ.get("QF", P.QUIET_FRACTION))
    rows = {
        "pipe none": run(base, rollout_pipeline=True),
        "concurrent 200ms": run(Lat(base, 0.2), trajectory_streams=True), "pipe 200ms": run(Lat(base, 0.2), rollout_pipeline=True),
        "concurrent heavy": run(Lat(base, 0.2, True), trajectory_streams=True), "pipe heavy": run(Lat(base, 0.2, True), rollout_pipeline=True),
    }
    for k, v in rows.items(): print(f"BENCH {k:18s} wall {v[0]:.3f}s chain {v[1]:.2f}s calls {v[2]}")
    print(f"BENCH QF {P.QUIET_FRACTION} limit(200ms) = {rows['pipe none'][0] + rows['pipe 200ms'][1]:.3f}s limit(heavy) = {rows['pipe none'][0] + rows['pipe heavy'][1]:.3f}s")
