#!/bin/sh
# The demo workload of slurm-idle: a "training run" that counts steps, checkpoints, and resumes.
#
# Parameters come from outside (the job spec's params, injected as PARAM_* env vars):
#   PARAM_STEPS (120), PARAM_STEP_S (1), PARAM_CHECKPOINT_EVERY (5).
# The checkpoint ($CHECKPOINT_DIR/state) holds "<step> <sum of step numbers so far>". On start it
# is read back (printing resumed_from=K when K>0); every CHECKPOINT_EVERY steps and on SIGTERM
# it is written atomically. The final line depends only on the step count, so an interrupted and
# resumed run prints exactly what an uninterrupted one does.
set -u
STEPS=${PARAM_STEPS:-120}
STEP_S=${PARAM_STEP_S:-1}
EVERY=${PARAM_CHECKPOINT_EVERY:-5}
DIR=${CHECKPOINT_DIR:-/checkpoint}
STATE="$DIR/state"

step=0
acc=0
if [ -s "$STATE" ]; then
  read -r step acc < "$STATE"
fi
echo "start restart=${SLURM_RESTART_COUNT:-0} job=${SLURM_JOB_ID:-none} step=$step t=$(date +%s)"
if [ "$step" -gt 0 ]; then
  echo "resumed_from=$step"
fi

save() {
  echo "$step $acc" > "$STATE.tmp" && mv "$STATE.tmp" "$STATE"
  echo "checkpoint step=$step t=$(date +%s)"
}

on_term() {
  save
  echo "preempted at step=$step t=$(date +%s): checkpoint saved, exiting"
  exit 143
}
trap on_term TERM

while [ "$step" -lt "$STEPS" ]; do
  # `sleep & wait` so SIGTERM is handled at once, not after the sleep.
  sleep "$STEP_S" &
  wait $!
  # One simple command: a trap cannot run between the two updates and save a torn state.
  acc=$((acc + step + 1)) step=$((step + 1))
  echo "step=$step"
  if [ $((step % EVERY)) -eq 0 ]; then
    save
  fi
done
save
echo "done steps=$step sum=$acc"
