"""FSDP2 wrapping in one process: compute dtypes per unit, AC composition, DCP round trip."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.unit


@pytest.fixture
def process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model(fixture_dir):
    from entrypoint.model import load_model

    return load_model(str(fixture_dir.model_dir), attn_implementation="sdpa")


@pytest.mark.parametrize("ac", ["none", "selective", "full"])
def test_bf16_compute_with_fp32_decay_params(fixture_dir, process_group, ac):
    from torch.distributed.device_mesh import init_device_mesh

    from entrypoint.distributed.parallelize import apply_activation_checkpointing, apply_fsdp

    model = _model(fixture_dir)
    wrapped = apply_activation_checkpointing(model, ac, every=2)
    assert wrapped == {"none": 0, "selective": 2, "full": 4}[ac]
    apply_fsdp(model, init_device_mesh("cpu", (1,)), param_dtype="bfloat16", reduce_dtype="float32")
    seen: dict[str, torch.dtype] = {}

    def record(name, getter):
        def hook(module, args, kwargs=None):
            seen[name] = getter(module).dtype
        return hook

    gdn = model.model.layers[0]
    gdn = getattr(gdn, "_checkpoint_wrapped_module", gdn).linear_attn
    gdn.register_forward_pre_hook(record("A_log", lambda m: m.A_log))
    gdn.register_forward_pre_hook(record("dt_bias", lambda m: m.dt_bias))
    gdn.in_proj_qkv.register_forward_pre_hook(record("in_proj_qkv", lambda m: m.weight))
    model.lm_head.register_forward_pre_hook(record("lm_head", lambda m: m.weight))
    ids = torch.randint(3, 300, (1, 24))
    logits = model(input_ids=ids, use_cache=False).logits
    assert seen == {"A_log": torch.float32, "dt_bias": torch.float32, "in_proj_qkv": torch.bfloat16,
                    "lm_head": torch.bfloat16}
    logits.float().sum().backward()
    # master weights and their gradients stay fp32 (sharded DTensors)
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32, name


def test_checkpoint_round_trip_restores_model_and_optimizer(fixture_dir, process_group, tmp_path):
    from torch.distributed.device_mesh import init_device_mesh

    from entrypoint.checkpoint.dcp import Checkpointer, list_checkpoints
    from entrypoint.distributed.parallelize import apply_fsdp

    def build():
        m = _model(fixture_dir)
        apply_fsdp(m, init_device_mesh("cpu", (1,)), param_dtype="float32", reduce_dtype="float32")
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2)

    ids = torch.randint(3, 300, (1, 16))
    model, opt = build()
    for _ in range(2):
        model(input_ids=ids, use_cache=False).logits.sum().backward()
        opt.step()
        opt.zero_grad()
    ckpt = Checkpointer(tmp_path / "ckpt", keep=1, rank=0, world_size=1)
    from tests.fixtures.checkpoints import trainer_state

    ckpt.save(2, model, opt, trainer_state(2))     # a whole trainer state: the load validates every field
    ckpt.save(3, model, opt, trainer_state(3))
    assert [p.name for p in list_checkpoints(tmp_path / "ckpt")] == ["step-00000003"]  # keep=1 pruned step 2
    after_save = torch.rand(3)  # what the RNG yields right after the save

    fresh, fresh_opt = build()
    torch.manual_seed(999)
    state = ckpt.load(tmp_path / "ckpt" / "step-00000003", fresh, fresh_opt)
    assert state.step == 3   # the typed, validated trainer state
    # the size manifest a resume checks before trusting the directory
    assert {".metadata", "rng-rank0.json"} <= set(state.files) and all(v > 0 for v in state.files.values())
    assert torch.equal(torch.rand(3), after_save)  # RNG restored
    for (n, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        torch.testing.assert_close(a.full_tensor(), b.full_tensor(), rtol=0, atol=0, msg=n)
    # the optimizer moments came back too: one more identical step gives identical weights
    for m, o in ((model, opt), (fresh, fresh_opt)):
        m(input_ids=ids, use_cache=False).logits.sum().backward()
        o.step()
    for (n, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        torch.testing.assert_close(a.full_tensor(), b.full_tensor(), rtol=0, atol=0, msg=n)
