#!/bin/bash
# Push-sum and gradient tracking against D-PSGD on digits, 16 nodes on the batched engine, seeds 1-3
# (benchmarks/RESULTS.md, "Push-sum and gradient tracking on digits"). Prints seed | run | accuracy.
common="--engine batched --nodes 16 --dataset digits --model mlp --rounds 5 --batch-size 32 --iterations 60 --test-after 60"
out=${1:-runs/pushsum-tracking}
mkdir -p "$out"
for seed in 1 2 3; do
  for cell in "dpsgd --topology ring --partition shards:2" "tracking --topology ring --partition shards:2" \
              "dpsgd --peer-sampling epidemic:1 --partition shards:2" \
              "pushsum --pushsum-step model --peer-sampling epidemic:1 --partition shards:2" \
              "pushsum --peer-sampling epidemic:1 --partition shards:2" \
              "dpsgd --topology one-peer-exponential --partition shards:2" \
              "pushsum --topology one-peer-exponential --partition shards:2"; do
    name=$(echo "$cell" | tr ' :' '__' | tr -s '_')-s$seed
    meshlearn simulate --algorithm $cell $common --lr 0.3 --seed "$seed" --output "$out/$name" > "$out/$name.log" 2>&1
    echo "$seed | $cell | $(grep 'test accuracy' "$out/$name.log" | awk '{print $3}')"
  done
done
