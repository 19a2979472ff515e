#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# The replication's runs (docs/rl.md, the addendum of issue 46), one
# after another, every one from the experiment's one commit: a worktree
# of that commit, its own packages first on PYTHONPATH (.venv-rl's
# editable installs point at this checkout, which moves on), so the code
# that runs is the commit's whatever this checkout holds.
#
# Usage: rl/experiment/rl_runs.sh COMMIT [RUN ...]
#   RUN: before, or <arm><seed> (A0 ... C2); default: all ten in order
#   (name the ones not in rl_arms.json yet, e.g. B0 C0 A1 B1 C1 A2 B2 C2).
# Each run's output goes to $RL_LOGS (default /tmp/rl-runs): RUN.out,
# RUN.err, RUN.done once recorded (a done run is skipped); a file named
# `pause` there holds the next run back until it is removed. Results are
# written to the worktree's models/smollm2-promise/rl_arms.json (and its
# plot): copy them here and commit after each run.
set -euo pipefail
root=$(cd "$(dirname "$0")/../../.." && pwd)
commit=${1:?give the experiment commit}
shift
logs=${RL_LOGS:-/tmp/rl-runs}
tree=${RL_WORKTREE:-$logs/worktree}
mkdir -p "$logs"
results=models/smollm2-promise/rl_arms.json
if [ ! -d "$tree" ]; then
  git -C "$root" worktree add --detach "$tree" "$commit"
  # The runs recorded so far (data, not code: the commit's file predates
  # them); each run adds its part to it.
  cp "$root/$results" "$tree/$results"
fi
[ "$(git -C "$tree" rev-parse HEAD)" = "$(git -C "$root" rev-parse "$commit")" ]
# The script as the commit has it: the recorded runs' commits predate its
# move from models/ to rl/experiment/ (and the trainer's from rl/ to
# rl/).
script=rl/experiment/rl_capitals.py
[ -e "$tree/$script" ] || script=models/rl_capitals.py
# The capitals task: in testkit/ at older commits, in training/ since.
export PYTHONPATH=$tree/common:$tree/v1:$tree/rl:$tree/rl/:$tree/testkit:$tree/training
runs=("$@")
if [ ${#runs[@]} -eq 0 ]; then
  runs=(before A0 B0 C0 A1 B1 C1 A2 B2 C2)
fi
for run in "${runs[@]}"; do
  [ -e "$logs/$run.done" ] && continue
  while [ -e "$logs/pause" ]; do sleep 20; done
  if [ "$run" = before ]; then
    args=(--evaluate before)
  else
    args=(--arm "${run:0:1}" --seed "${run:1}")
  fi
  echo "$(date -u +%FT%TZ) start $run" >>"$logs/runs.log"
  (cd "$tree" && "$root/.venv-rl/bin/python" "$script" \
    "${args[@]}" >"$logs/$run.out" 2>"$logs/$run.err")
  touch "$logs/$run.done"
  echo "$(date -u +%FT%TZ) done $run" >>"$logs/runs.log"
done
