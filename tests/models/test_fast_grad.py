"""models.fast_grad: meta steps without importing torch._dynamo, bit-identical, guarded by a pin."""

import logging
import subprocess
import sys
import textwrap

import torch
import torch._functorch.eager_transforms as eager

import models.meta  # noqa: F401  (installs models.fast_grad)
from models import fast_grad

# In a fresh process: meta steps with the replacement (no dynamo may get imported),
# then the same steps with torch's original function (which imports dynamo), compared bit for bit.
_FRESH = textwrap.dedent(
    """
    import sys
    import torch
    import torch._functorch.eager_transforms as eager
    from models import ModelConfig, build_model, fast_grad
    from models.meta import AdaptTarget, MetaConfig, meta_step
    from models.testing import assert_steps_identical, random_meta_batch, random_rows, synthetic_schema

    assert eager._autograd_grad is fast_grad._autograd_grad, "not installed"
    g = torch.Generator().manual_seed(0)
    schema = synthetic_schema(n_sparse=2, n_multi_hot=1, n_text=1, n_dense=2, vector_dim=4, max_len=3)
    model = build_model(schema, ModelConfig(kind="dnn", hidden=[8], default_dim=4))
    mb = random_meta_batch(schema, tasks=4, support=5, query=4, vocab=8, generator=g, pad_tasks=1)
    rows = random_rows(mb.unique_ids, model.dims, g, scale=0.5)
    cfgs = [MetaConfig(inner_steps=2, inner_lr=0.3, first_order=False, adapt=AdaptTarget.BOTH),
            MetaConfig(inner_steps=1, inner_lr=0.3, first_order=True, adapt=AdaptTarget.ROWS)]
    fast = [meta_step(model, mb, rows, c) for c in cfgs]
    assert "torch._dynamo" not in sys.modules, "a meta step imported torch._dynamo"
    assert "torch._inductor" not in sys.modules, "a meta step imported torch._inductor"
    eager._autograd_grad = fast_grad._original
    slow = [meta_step(model, mb, rows, c) for c in cfgs]
    assert "torch._dynamo" in sys.modules  # the original ran
    for a, b in zip(fast, slow):
        assert_steps_identical(a, b)
    print("OK")
    """
)


def test_meta_steps_import_no_dynamo_and_equal_the_original_bit_for_bit() -> None:
    r = subprocess.run([sys.executable, "-c", _FRESH], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stderr[-3000:]


def test_with_dynamo_loaded_every_call_goes_to_the_original(monkeypatch) -> None:
    calls = []

    def spy(*a):
        calls.append(a)
        return ("from the original",)

    monkeypatch.setattr(fast_grad, "_original", spy)
    monkeypatch.setitem(sys.modules, "torch._dynamo", sys.modules.get("torch._dynamo", object()))
    x = torch.ones(2, requires_grad=True)
    assert fast_grad._autograd_grad([x.sum()], [x]) == ("from the original",)
    assert len(calls) == 1


def test_the_guard_refuses_another_version_or_source_and_leaves_torch_untouched(monkeypatch, caplog) -> None:
    original = fast_grad._original
    assert original is not None and eager._autograd_grad is fast_grad._autograd_grad
    assert fast_grad.matches_pin(original, torch.__version__) is None
    assert "not the pinned" in (fast_grad.matches_pin(original, "2.14.0+cpu") or "")

    def changed(outputs, inputs, grad_outputs=None, retain_graph=False, create_graph=True):
        return torch.autograd.grad(outputs, inputs, grad_outputs, retain_graph=retain_graph, create_graph=create_graph)

    assert "source sha256" in (fast_grad.matches_pin(changed, torch.__version__) or "")
    monkeypatch.setattr(eager, "_autograd_grad", changed)
    with caplog.at_level(logging.DEBUG, logger="models.fast_grad"):
        assert fast_grad.install() is False
    assert eager._autograd_grad is changed
    why = [r.kv["why"] for r in caplog.records if r.getMessage() == "torch's _autograd_grad left as is"]
    assert len(why) == 1 and "source sha256" in why[0], why
