"""entrypoint: `docker run IMAGE finetune|verify|info|shell` (anything else is exec'd).

How `finetune` flows through the modules:

  cli.py          argv -> subcommand; other argv exec'd as a plain command
  finetune.py     config layers (lock defaults < YAML < flags < KEY=VALUE) -> verify gate
                  (gate.py) -> packing decision -> run plan -> torchrun (launch.py)
  train.py        per-rank worker: plan -> Trainer -> run_report.json
  trainer.py      build (data, model, FSDP2, optimizer) -> resume -> fit -> finish
    data.py       chat rows -> tokens + assistant-only labels; bad rows counted
    packing.py    lengths -> micro-batches (BFD 1D, greedy, 2D padded)
    sampler.py    deterministic, checkpointable stream of micro-batches across ranks
    batches.py    micro-batch tensors (collate.py for packed rows, 2D padding here)
    model.py      tokenizer + model (rank 0 reads weights, other ranks build on meta)
    parallelize.py activation checkpointing + fully_shard per unit
    checkpoint.py atomic DCP checkpoints, resume, HF export
    metrics.py    tokens/s, padding, packing efficiency, MFU, memory
    profiling.py  torch.profiler window
  testing.py      tiny model / tokenizer / chat data fixtures (tests and container tests)
"""
