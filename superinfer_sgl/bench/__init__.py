"""A/B benchmark harness: stock SGLang vs our server, driven by SGLang's own load generator.

Modules, in the order a run uses them:
  profiles   the named setups (smoke, cpu, gpu): model, KV budget, SLOs, workloads, rate sweep
  workloads  seeded request sets (ShareGPT-like lengths, SLO classes) and arrival schedules
  traces     user trace files (Azure CSV, Mooncake/JSONL, ShareGPT JSON) -> requests + timestamps
  prompts    prompts of exact token lengths from the model's tokenizer, written as `openai` JSONL
  servers    command lines for every system and process-group lifetime (always stopped)
  client     runs sglang.benchmark.serving with our arrival schedule and reads its per-request output
  metrics    SLO attainment, goodput, percentiles from per-request ttft/itl; Prometheus counters
  report     JSON, markdown table, PNG plots, target checks
  runner     the sweep: for each system, start its server, run every rate, stop it
"""
