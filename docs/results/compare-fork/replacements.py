"""Kill to the replacement's first inner step, for each kill of the mtbf30 Decoupled runs.

    python replacements.py /tmp/cmpfull/mtbf30/decoupled > replacements.txt

(the compare's run directories; the n-th learner beyond the first four to start training
is taken as the n-th kill's replacement)."""
import glob
import json
import sys

root = sys.argv[1]
for seed in sorted(glob.glob(f"{root}/seed*")):
    kills = [json.loads(line) for line in open(f"{seed}/chaos.jsonl") if '"kill"' in line]
    firsts = {}
    for path in glob.glob(f"{seed}/learners/*.events.jsonl"):
        learner = path.rsplit("/", 1)[1].split(".")[0]
        for line in open(path):
            event = json.loads(line)
            if event.get("kind") == "state" and event.get("state") == "computing":
                firsts[learner] = event["t"]
                break
    later = sorted((t, learner) for learner, t in firsts.items() if learner not in {"L0", "L1", "L2", "L3"})
    for kill, (t, learner) in zip(kills, later):
        print(seed.rsplit("/", 1)[1], f"kill of {kill['learner']} (after {kill['inner_steps']} inner steps) -> "
              f"{learner} first inner step {t - kill['t']:.2f} s later")
