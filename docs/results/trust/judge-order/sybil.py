"""The CI's sybil run (tests/cluster/test_hostile_local.py: 2 honest learners of the tiny
model for 1500 steps, the validator on, 3 `negate` attackers of the run's credential)
RUNS times, beside HOGS busy loops (a loaded CI machine), into OUT. Prints, per run: the
exit, eval and attackers' log lines; the honest learners' judgements (median cosine, 5th
percentile, how many counted less than in full, how many nothing); the attackers' trust
(median, mean), the median factor their merged pushes counted at, and every attacker
judgement (time, learner, fragment, seq, cosine, trust).

    python docs/results/trust/judge-order/sybil.py OUT HOGS RUNS [ATTACK]
"""
import multiprocessing, statistics, sys, time
from pathlib import Path
from diloco.lab.bench.hostile import one_run
from diloco.tape import read_tape

TINY = ["--width", "32", "--depth", "1", "--heads", "2", "--context", "32", "--fragments", "4", "--sync-every", "8",
        "--batch-size", "8"]

def hog():
    while True:
        pass

if __name__ == "__main__":
    out, hogs, runs = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    procs = [multiprocessing.Process(target=hog, daemon=True) for _ in range(hogs)]
    for p in procs: p.start()
    try:
        for i in range(runs):
            o = out / f"r{i}"; o.mkdir(parents=True, exist_ok=True)
            r = one_run(o, 0, sys.argv[4] if len(sys.argv) > 4 else "negate", 2, 1500, 0.1, [*TINY, "--validator"], attackers=3)
            d = o / f"{r['attack']}-seed0"
            recs = [x for t in sorted(d.glob("shard*/tape-*.jsonl")) for x in read_tape(t)]
            honest = {p.name.removesuffix(".json") for p in (d / "learners").glob("*.json")}
            att = [x for x in recs if x["kind"] == "trust" and x["learner"] not in honest]
            tr = [x["trust"] for x in att]
            hon = [x for x in recs if x["kind"] == "trust" and x["learner"] in honest]
            hs = sorted(x["score"] for x in hon if x["score"] is not None)
            if hs:
                print(f"  honest judged {len(hon)} median score {hs[len(hs)//2]:.3f} p5 {hs[len(hs)//20]:.3f} trust<1: {sum(1 for x in hon if x['trust'] < 1)} trust0: {sum(1 for x in hon if x['trust'] == 0)}", flush=True)
            print(f"run {i}: exit {r['exit']} wall {r['wall_s']} eval {r['eval_final']} attackers {r['attacker']}", flush=True)
            print(f"  judged {len(tr)} median {statistics.median(tr) if tr else None} mean {statistics.mean(tr) if tr else None} factor {r['attacker_factor_median']}", flush=True)
            for x in att:
                print(f"  {x.get('t', 0)} {x['learner']} f{x['fragment']} seq {x['seq']} score {x['score']} trust {x['trust']}", flush=True)
    finally:
        for p in procs: p.terminate()
