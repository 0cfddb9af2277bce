#!/bin/bash
# The single-process model's runs of docs/results/outer/README.md ("A model without the
# wire"), one after another (about 25 min on 2 cores); one JSON line each, as in results.jsonl.
# Run from the repository root.
S="env OMP_NUM_THREADS=1 PYTHONPATH=. python docs/results/outer/sim/sim.py"
$S --mode dp                                   # DP, 4 workers
$S --mode avg --H 1                            # 4 AdamW learners averaged after every step
$S --mode avg --H 8                            # ... after every 8 steps
$S --mode avg --H 1 --clip 0
$S --mode dp --clip 0
$S --mode avg --H 1 --noise-m 4                # noise from the gradient's time series
$S --mode avg --H 8 --outer-lr 0.7 --outer-mom 0.9
$S --mode avg --H 1 --lr 4.5e-3
$S --mode avg --H 1 --M 2
$S --mode avg --H 1 --M 8
$S --mode dp --M 2
$S --mode dp --M 8
$S --mode avg --H 1 --noise-m 4 --split        # noise from the batch's two halves (adamw-pooled)
$S --mode avg --H 8 --noise-m 4 --split
$S --mode avg --H 8 --noise-m 4 --split --gain # plain AdamW locally, the pooled gain on the averaged delta
# Later (docs/results/default-h4/ era): averaging the learners' AdamW state at each sync, and
# classic DiLoCo's lower inner lr with outer Nesterov, H = 8 (the batch-size runs were stopped).
$S --mode avg --H 8 --avg-m                    # the first moments averaged too
$S --mode avg --H 8 --avg-m --avg-v            # both moments
$S --mode avg --H 8 --lr 1.5e-3 --outer-lr 1.0 --outer-mom 0.5
$S --mode avg --H 8 --outer-lr 1.5
