#!/usr/bin/env bash
# The figure of RESULTS "Session 44": recall_vs_read_128k_s44.png
cd "$(dirname "$0")/../../.."
F1=benchmarks/results/s44/seeds_walk_128k.json; F2=benchmarks/results/s44/seeds_128k.json; F3=benchmarks/results/roargraph/recall_128k_reads_session35.json
.venv/bin/python benchmarks/scripts/plot_recall.py benchmarks/results/figures/recall_vs_read_128k_s44.png "$F1" "$F2" "$F3" \
  --drop "$F3:BF16,RoarGraph32|walk_bits=8" --drop "$F3:BF16,LSHSample10x150" --drop "$F3:RoarGraph32|walk_bits=8" \
  --drop "$F3:RoarGraph64|walk_bits=8" --drop "$F2:RoarGraph32" \
  --drop "$F2:RoarGraph32|max_train_queries=32768,n_anchors=32768,n_hubs=0,keys_per_seed_list=0,max_expansions=0,anchors_per_group=128" \
  --label "$F1:RoarGraph32|n_hubs=0,keys_per_seed_list=0,anchors_per_group=192,seed_anchors=64,max_train_queries=32768,n_anchors=32768=RoarGraph32, 32768 anchors, 64 seed lists, max_expansions 10-30" \
  --label "$F1:RoarGraph32|n_hubs=0,keys_per_seed_list=0,anchors_per_group=192,seed_anchors=64,max_train_queries=24576,n_anchors=24576=RoarGraph32, 24576 anchors, 64 seed lists, max_expansions 10-30" \
  --label "$F2:RoarGraph32|max_train_queries=32768,n_anchors=32768,n_hubs=0,keys_per_seed_list=0,max_expansions=0,anchors_per_group=192=RoarGraph32, 32768 anchors, seed lists only (64-160)" \
  --label "$F2:RoarGraph32|max_train_queries=32768,n_anchors=32768,n_hubs=0,keys_per_seed_list=0,seed_anchors=64,anchors_per_group=192=RoarGraph32, 32768 anchors, 64 seed lists, max_expansions 0-40, whole" \
  --label "$F3:RoarGraph32=RoarGraph32 defaults (efSearch 100-500, session 35)" \
  --reference "official RoarGraph (distance computations)=benchmarks/results/roargraph/official_roargraph_128k.txt"
