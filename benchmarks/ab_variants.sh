# Sourced by benchmarks/w14_ab.sh and attention_ab.sh: the variants of an A/B run. A variant is
#   base                  this tree as it is
#   ATTENTION_DQ=0,...    KILN_TUNE_* settings (without the prefix), comma-separated
#   --two-programs        flags for the program, '+'-separated (--two-programs+--f32)
#   tree:DIR              another source tree, e.g. an older commit unpacked on the host with
#                         `git archive REV | tar -x -C DIR` and carried to the device

# ab_build TARGET VARIANT...: sets `trees` (. and every tree:DIR's DIR) and builds TARGET in each
# tree's build/ at once (AB_NO_BUILD=1: already built); non-zero when a build failed.
ab_build() {
  local target=$1 v tr status=0
  shift
  trees=(.)
  for v in "$@"; do [[ $v == tree:* ]] && trees+=("${v#tree:}"); done
  [ "${AB_NO_BUILD:-0}" = 1 ] && return 0
  for tr in "${trees[@]}"; do
    (cd "$tr" && cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DKILN_BUILD_TESTS=OFF > build.log 2>&1 &&
      cmake --build build --target "$target" -j "$(($(nproc) / ${#trees[@]} + 1))" >> build.log 2>&1) &
  done
  for tr in "${trees[@]}"; do
    wait -n || status=1
  done
  if [ "$status" != 0 ]; then
    for tr in "${trees[@]}"; do tail -5 "$tr/build.log"; done
    echo "the build of $target failed (build.log in each tree)"
  fi
  return "$status"
}

# ab_variant VARIANT: sets `tr` (its tree), `envs` (its KILN_TUNE_* settings) and `flags`.
ab_variant() {
  local kv s
  tr=. envs=() flags=()
  case $1 in
    base) ;;
    tree:*) tr=${1#tree:} ;;
    --*) IFS=+ read -ra flags <<< "$1" ;;
    *)
      IFS=, read -ra kv <<< "$1"
      for s in "${kv[@]}"; do envs+=("KILN_TUNE_$s"); done
      ;;
  esac
}
