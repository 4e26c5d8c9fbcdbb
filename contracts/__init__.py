"""Contracts that cross the project's parts: what build/ writes and verify/ and
entrypoint/ read, and the small utilities all three must agree on.

    lock             the build lock (the image's single source of truth)
    collate          the packed-batch format every fused kernel needs
    atomic           files that appear whole or not at all
    events           the one progress-event schema (build, compile, finetune)
    errors           the one error type with its fix (every part's errors subclass it)
    schema           the one type-driven validation engine and its Problem type
    safe_yaml        YAML loading that refuses hostile documents by construction
    finetune_config  the finetune config schema (build validates image defaults with it)
    table            the one plain-text table printer

Nothing here imports build/, verify/ or entrypoint/; they import it.
"""
