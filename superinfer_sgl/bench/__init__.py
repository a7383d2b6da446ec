"""A/B benchmark harness: stock SGLang vs our server, driven by SGLang's own load generator.

Modules, in the order a run uses them (docs/ab.md describes the method):
  cli        command-line options (scripts/ab_bench.py)
  planning   options -> a Plan: profile overrides, requests, sweep points, systems, shared flags
  profiles   the named setups (smoke, cpu, gpu): model, KV budget, SLOs, lengths, rates
  workloads  seeded request sets (ShareGPT-like lengths, SLO classes) and arrival schedules
  traces     user trace files (Azure CSV, Mooncake/JSONL, ShareGPT JSON) -> requests + timestamps
  prompts    prompts of exact token lengths from the model's tokenizer, written as `openai` JSONL
  servers    command lines for every system and process-group lifetimes (always stopped)
  rundoc     datasets and schedules on disk; the reproducibility block of ab.json
  abfile     ab.json on disk: plain, or gzipped (ab.json.gz) past the 1 MiB a tracked file may hold
  kv_pool    every server's KV pool size, read once it is up; the A/B refuses pools that differ
  calibrate  speed probe -> SLOs, rates and request count scaled to the machine (cpu profile)
  client     runs sglang.benchmark.serving with our arrival schedule, reads its per-request output
  metrics    SLO attainment, goodput, percentiles from per-request ttft/itl; Prometheus counters
  runner     the sweep: start servers, (calibrate,) run every point on every system, stop, report
  report     markdown table, PNG plots, target checks, noise band
  gpu_ab     helpers of scripts/gpu_ab.sh (stage timeline, CUDA-graph fallback decision)

The KV transfer benchmark of the engine's own copy paths (python -m superinfer_sgl.bench.kv_transfer):
  kv_transfer      options, sections, report; transfer_rig the rig, methods and timing;
  transfer_sweeps  the sweeps and the model-shaped rotation through RotationEngine
"""
