#!/usr/bin/env bash
# `make test` in two phases, so the slow builds overlap with the tests that need none of them:
#   1. the images (.ci/images/build.sh) and the control plane's Go build (.ci/cluster/build.sh) start in the
#      background, niced so the tests keep their speed, while every test not marked `cluster` or `images` runs;
#   2. once both builds are done, up.py starts the cluster (its binaries now cached) and the `cluster` and `images`
#      tests run;
#   3. the `disruptive` ones (they stop the API server or the kubelet under a job) run last, one at a time, so no
#      other test sees the outage they inject.
# A build that fails makes its tests skip, or, under WANLOOM_REQUIRE_IMAGES / WANLOOM_REQUIRE_E2E (CI), stops the
# run with the build's log. Build logs: build/logs/. Environment from the Makefile: PY, IMAGES, PYTEST_ARGS.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
IMAGES=${IMAGES:-operator tpu}
LOGS=build/logs
mkdir -p "$LOGS"
# --durations: the slowest tests in every log, to see what a cold run spends its 75 minutes on.
PYTEST=("$PY" -m pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=40)
# shellcheck disable=SC2206 # PYTEST_ARGS is a list of words, as make passes it
EXTRA=(${PYTEST_ARGS:-})

# Free disk in every log: a full disk fails tests far from its cause (the images, containerd's store, /tmp).
disk() { echo "test.sh: $1: $(df -h --output=avail / | tail -n 1 | tr -d ' ') free on /"; }
started=$SECONDS
disk "start"
# shellcheck disable=SC2086 # IMAGES is a list of names
nice -n 10 .ci/images/build.sh $IMAGES > "$LOGS/images.log" 2>&1 &
images=$!
nice -n 10 .ci/cluster/build.sh > "$LOGS/cluster-build.env" 2> "$LOGS/cluster-build.log" &
cluster=$!

"${PYTEST[@]}" -m "not exhaustive and not cluster and not images" "${EXTRA[@]}"
first=$?
echo "test.sh: tests without the cluster or images: exit $first after $((SECONDS - started)) s; waiting for the builds"
disk "after the first phase"

# finished NAME PID LOG REQUIRE_VAR: waits for a build; fails the run where its tests are required.
finished() {
  local name=$1 pid=$2 log=$3 require=$4
  if wait "$pid"; then
    echo "test.sh: $name built ($((SECONDS - started)) s since the start)"
    return 0
  fi
  echo "test.sh: $name build failed; the end of $log:" >&2
  tail -n 30 "$log" >&2
  [ -z "${!require:-}" ]
}
finished images "$images" "$LOGS/images.log" WANLOOM_REQUIRE_IMAGES || exit 1
finished "control plane" "$cluster" "$LOGS/cluster-build.log" WANLOOM_REQUIRE_E2E || exit 1
"$PY" .ci/cluster/up.py || [ -z "${WANLOOM_REQUIRE_E2E:-}" ] || exit 1

"${PYTEST[@]}" -m "not exhaustive and (cluster or images) and not disruptive" "${EXTRA[@]}"
second=$?
echo "test.sh: cluster and image tests: exit $second; $((SECONDS - started)) s so far"
disk "after the second phase"
"$PY" -m pytest -p no:xdist --durations=10 -m "not exhaustive and disruptive" "${EXTRA[@]}"
third=$?
echo "test.sh: disruptive tests: exit $third; $((SECONDS - started)) s in all"
# pytest's 5 is "nothing selected" (a PYTEST_ARGS path with no test of that kind), not a failure.
for code in $first $second $third; do [ "$code" = 0 ] || [ "$code" = 5 ] || exit "$code"; done
