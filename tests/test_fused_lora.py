"""learner.fused_lora against peft's LoRA path, on CPU: the autograd function (float32 exact where
the scale is a power of two, else within float32 rounding: peft multiplies the product by s, the
fused GEMM takes s as its alpha; float64 gradcheck; bf16 under autocast within bf16 rounding), a
whole PolicyLearner update with learner.fused_lora on and off (the same bits), the reference
policy (adapter disabled) still the base model, the per-step cast copies, and the config's refusal."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from config import RunConfig
from learner.fused_lora import FusedLora, LoraLinearFn
from learner.lora import adapter_state_dict
from learner.passes import GradSync
from learner.policy import PolicyLearner
from tests.test_learner_gpu_opts import gradients, two_groups
from tests.test_shared_prefix import VOCAB, lora, tiny_llama


class OneLinear(torch.nn.Module):
    def __init__(self, bias: bool = True):
        super().__init__()
        self.lin = torch.nn.Linear(48, 40, bias=bias)

    def forward(self, x):
        return self.lin(x)


def adapted(alpha: float, r: int = 4, bias: bool = True, dtype=torch.float32):
    """A peft LoRA around one linear layer, B drawn (peft starts it at zero), and a copy of it."""
    torch.manual_seed(0)
    model = get_peft_model(OneLinear(bias).to(dtype), LoraConfig(r=r, lora_alpha=alpha, target_modules=["lin"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    return model, copy.deepcopy(model)


def forward_backward(model, x, g, amp: torch.dtype | None = None):
    """Output, grad of x and the LoRA gradients of one forward/backward (``amp``: under CPU autocast)."""
    x = x.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=amp, enabled=amp is not None):
        y = model(x)
    y.backward(g.to(y.dtype))
    grads = {n.split(".")[-3]: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return y.detach(), x.grad, grads


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


# ------------------------------------------------------------------ the function against peft's layer
@pytest.mark.parametrize("bias", [True, False])
def test_fused_layer_is_pefts_bit_for_bit_when_the_scale_is_a_power_of_two(bias):
    model, ref = adapted(alpha=8, bias=bias)  # s = 8 / 4 = 2: scaling before or after the sum rounds alike
    fused = FusedLora(model)
    x, g = torch.randn(3, 7, 48), torch.randn(3, 7, 40)
    y, gx, grads = forward_backward(model, x, g)
    y_ref, gx_ref, grads_ref = forward_backward(ref, x, g)
    assert fused.stats()["fused_forwards"] == 1 and fused.stats()["peft_forwards"] == 0
    assert torch.equal(y, y_ref) and torch.equal(gx, gx_ref)
    assert set(grads) == {"lora_A", "lora_B"}
    for name in grads:
        assert torch.equal(grads[name], grads_ref[name]), name
        assert grads[name].dtype == torch.float32 and grads[name].abs().max() > 0


def test_fused_layer_matches_peft_to_float32_rounding_for_any_scale():
    model, ref = adapted(alpha=6)  # s = 1.5: (x A B) s against s folded into the GEMM: one rounding apart
    FusedLora(model)
    x, g = torch.randn(3, 7, 48), torch.randn(3, 7, 40)
    y, gx, grads = forward_backward(model, x, g)
    y_ref, gx_ref, grads_ref = forward_backward(ref, x, g)
    assert relative(y, y_ref) < 1e-6 and relative(gx, gx_ref) < 1e-6
    for name in grads:
        assert relative(grads[name], grads_ref[name]) < 1e-6, name


def test_a_hook_on_the_base_layer_still_runs_and_is_differentiated():
    """model/shared_base.py ServedCorrection hooks the base layer: the base forward then runs as
    itself and only the LoRA term is fused into its output."""
    model, ref = adapted(alpha=8)
    fused = FusedLora(model)
    w = torch.randn(40, 48) * 0.1

    def correction(module, args, out):  # like ServedCorrection's: a term in x, subtracted
        return out - args[0] @ w.t()

    for m in (model, ref):
        m.base_model.model.lin.base_layer.register_forward_hook(correction)
    x, g = torch.randn(2, 5, 48), torch.randn(2, 5, 40)
    y, gx, grads = forward_backward(model, x, g)
    y_ref, gx_ref, grads_ref = forward_backward(ref, x, g)
    assert fused.stats()["fused_forwards"] == 1
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    torch.testing.assert_close(gx, gx_ref, rtol=0, atol=2e-7)  # g W0 and g w summed by autograd: order differs
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=0, atol=0)


@pytest.mark.parametrize("base_given", [False, True])
def test_gradcheck_in_float64(base_given):
    torch.manual_seed(1)
    d = dict(dtype=torch.float64)
    x = torch.randn(2, 3, 6, **d, requires_grad=True)
    w0, bias = torch.randn(5, 6, **d), torch.randn(5, **d)
    a = torch.randn(2, 6, **d, requires_grad=True)
    b = torch.randn(5, 2, **d, requires_grad=True)
    if base_given:
        base = torch.randn(2, 3, 5, **d, requires_grad=True)
        fn = lambda x, base, a, b: LoraLinearFn.apply(x, base, None, None, a, b, a, b, 1.5)  # noqa: E731
        inputs = (x, base, a, b)
    else:
        fn = lambda x, a, b: LoraLinearFn.apply(x, None, w0, bias, a, b, a, b, 1.5)  # noqa: E731
        inputs = (x, a, b)
    assert torch.autograd.gradcheck(fn, inputs)


def test_bf16_autocast_matches_pefts_autocast_path_within_bf16_rounding():
    """Under autocast peft casts the float32 A and B to bf16 in every forward and rounds the LoRA
    term, its scaling and the add separately; the fused layer casts them once and rounds once.
    Both against float64 truth: the fused error is no larger than peft's (to a bf16 ulp's slack),
    and the two agree within 2 bf16 ulps (2^-7 relative to the largest value)."""
    model, ref = adapted(alpha=8, dtype=torch.bfloat16)  # a bf16 base; peft keeps the adapter in float32
    assert model.base_model.model.lin.lora_A["default"].weight.dtype == torch.float32
    fused = FusedLora(model, compute_dtype=torch.bfloat16)
    truth = copy.deepcopy(ref).double()
    x, g = torch.randn(4, 9, 48), torch.randn(4, 9, 40)
    out = forward_backward(model, x, g, amp=torch.bfloat16)
    out_ref = forward_backward(ref, x, g, amp=torch.bfloat16)
    out_true = forward_backward(truth, x.double(), g.double())
    assert fused.stats()["fused_forwards"] == 1 and out[0].dtype == torch.bfloat16
    pairs = [(out[0], out_ref[0], out_true[0]), (out[1], out_ref[1], out_true[1])]
    pairs += [(out[2][n], out_ref[2][n], out_true[2][n]) for n in ("lora_A", "lora_B")]
    for ours, peft_, true in pairs:
        assert relative(ours, peft_) < 2 ** -6
        assert relative(ours, true) <= relative(peft_, true) + 2 ** -8
    assert all(grad.dtype == torch.float32 for grad in out[2].values())  # on the float32 masters


def test_cast_copies_are_made_once_and_refreshed_after_an_optimizer_step():
    """The bf16 copies are persistent buffers: a second forward makes none, a fused AdamW step
    (which does not move the version counter) reaches the forward through the learner's refreshing
    optimizer step, not otherwise, and the refresh rewrites the buffers in place (a CUDA graph
    captured before it reads the new values)."""
    model, ref = adapted(alpha=8, dtype=torch.bfloat16)
    fused = FusedLora(model, compute_dtype=torch.bfloat16)
    buffers = [entry[1] for entry in fused.cache.entries.values()]
    assert len(buffers) == 2
    x, g = torch.randn(2, 3, 48), torch.randn(2, 3, 40)
    forward_backward(model, x, g, amp=torch.bfloat16)
    assert all(e[1] is b for e, b in zip(fused.cache.entries.values(), buffers))  # the same tensors, no new copy
    addresses = [b.data_ptr() for b in buffers]  # a captured CUDA graph reads these addresses
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=0.5, fused=True)

    def opt_step() -> float:
        opt.step()
        return 0.0

    sync = PolicyLearner._refreshing(GradSync(backward=lambda loss, last: loss.backward(), step=opt_step), fused)
    sync.step()
    ref.load_state_dict(model.state_dict())
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y, y_ref = model(x), ref(x)
    assert relative(y, y_ref) < 2 ** -6
    for master, buf in zip(trainable, buffers):
        assert torch.equal(buf, master.detach().to(torch.bfloat16))
    assert [e[1].data_ptr() for e in fused.cache.entries.values()] == addresses  # rewritten in place


def test_peft_forward_runs_where_fusing_does_not_apply():
    model, ref = adapted(alpha=8)
    fused = FusedLora(model)
    x = torch.randn(2, 48)
    layer = model.base_model.model.lin
    with torch.no_grad():
        with model.disable_adapter():  # the reference policy
            assert torch.equal(model(x), ref.base_model.model.lin.base_layer(x))
        assert fused.stats()["peft_forwards"] == 1
        layer.lora_dropout["default"] = torch.nn.Dropout(0.5)  # dropout: peft's path, in train mode too
        model.train()
        model(x)
        assert fused.stats() == {"layers": 1, "fused_forwards": 0, "peft_forwards": 2, "cast_copies": 0}
        fused.restore()
        assert "forward" not in vars(layer)


# ------------------------------------------------------------------ the whole model and the learner
def test_disabled_adapter_is_still_the_base_model_with_fused_layers():
    base = tiny_llama()
    model = lora(tiny_llama())
    fused = FusedLora(model)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = base(input_ids=ids).logits
        with model.disable_adapter():
            got = model(input_ids=ids).logits
        adapted_ = model(input_ids=ids).logits
    assert torch.equal(got, want)
    assert not torch.allclose(adapted_, want, atol=1e-3)
    n = len(fused.layers)
    assert n == 2 * 3 and fused.stats()["peft_forwards"] == n and fused.stats()["fused_forwards"] == n


def learner_steps(model_dir, steps: int = 2, **learner):
    """Metrics and adapters of ``steps`` PolicyLearner steps on the same batches (B starts at zero,
    so the A gradients are zero in the first step: the second step checks them)."""
    cfg = RunConfig.model_validate({
        "seed": 0, "model": {"name_or_path": str(model_dir)},
        "learner": {"lr": 1e-2, "micro_batch_size": 4, "lora": {"r": 4, "alpha": 8}, **learner},
        "rollout": {"temperature": 0.7}, "trainer": {"steps": steps},
    })
    policy = PolicyLearner.for_run(cfg)
    out = [({}, {n: v.clone() for n, v in adapter_state_dict(policy.peft_model).items()})]  # the init
    for k in range(steps):
        metrics, _ = policy.step(two_groups(torch.Generator().manual_seed(3 + k)))
        out.append((metrics, {n: v.clone() for n, v in adapter_state_dict(policy.peft_model).items()}))
    return policy, out


@pytest.mark.parametrize("cut", [{}, {"size": 4}, {"size": 4, "share_prefix": False}])
def test_whole_model_loss_is_pefts_bit_for_bit_and_gradients_to_float32_rounding(cut):
    """The forward is the same ops in the same order (s = 2): the same loss, bit for bit. The LoRA
    gradients differ by summation order only: a layer input's gradient is g W0 + s (g B) A summed
    inside one addmm per projection, where autograd sums peft's two branches of q, k and v (and
    of gate and up) one by one."""
    model = lora(tiny_llama())  # q, v and down adapted, B drawn
    ref = copy.deepcopy(model)
    fused = FusedLora(model)
    batch = two_groups(torch.Generator().manual_seed(7))
    _, loss_ref, grads_ref = gradients(ref, batch, "dapo", **dict(cut))
    _, loss, grads = gradients(model, batch, "dapo", **dict(cut))
    assert fused.stats()["fused_forwards"] > 0 and fused.stats()["peft_forwards"] == 0
    assert loss == loss_ref
    for name, want in grads_ref.items():
        assert want.abs().max() > 0, name
        assert relative(grads[name], want) < 2e-6, name


@pytest.mark.parametrize("extra", [{}, {"fold_old_logprobs": False, "beta": 0.05},
                                   {"gradient_checkpointing": True, "epochs_per_step": 2}])
def test_policy_update_is_the_same_with_fused_lora(tmp_path, extra):
    """Step 1 (B = 0: only B moves, and g^T (x A^T) is one GEMM either way) is bit for bit; from
    step 2 the A gradients carry the summation-order difference above, which AdamW's first steps
    (update ~ lr g / |g|) scale up where a gradient element is near zero: 6e-5 of the
    movement seen here, against O(1) for a wrong scale or a missing term. With two epochs a step,
    step 1's second epoch already has B != 0: its forward stays bit for bit (loss, ppl_ratio), its
    grad_norm (the last epoch's) carries that difference (1 ulp on an AVX-512 FP16 Xeon)."""
    tiny_llama(tmp_path)
    plain, plain_steps = learner_steps(tmp_path, fused_lora=False, **extra)
    fused, fused_steps = learner_steps(tmp_path, fused_lora=True, **extra)
    assert plain.stats()["fused_lora"] is None
    stats = fused.stats()["fused_lora"]
    assert stats["layers"] == 2 * 7 and stats["fused_forwards"] > 0  # all-linear: 7 per decoder layer
    assert stats["peft_forwards"] == (stats["fused_forwards"] // 2 if "beta" in extra else 0)  # ref: adapter off
    init = plain_steps[0][1]
    assert all(torch.equal(fused_steps[0][1][name], v) for name, v in init.items())
    (m1_plain, a1_plain), (m1_fused, a1_fused) = plain_steps[1], fused_steps[1]
    exact = 2 if "epochs_per_step" not in extra else 1  # two epochs: step 1 moves A too
    for key in ("loss", "grad_norm", "ppl_ratio", "kl"):
        if key == "grad_norm" and exact == 1:
            assert m1_fused[key] == pytest.approx(m1_plain[key], rel=1e-6), key
        else:
            assert m1_fused.get(key) == m1_plain.get(key), key
    if exact == 2:
        for name, want in a1_plain.items():
            assert torch.equal(a1_fused[name], want), name
    for (m_plain, a_plain), (m_fused, a_fused) in zip(plain_steps[exact:], fused_steps[exact:]):
        for key in ("loss", "grad_norm", "ppl_ratio"):
            assert m_fused[key] == pytest.approx(m_plain[key], rel=1e-6), key
        for name, want in a_plain.items():
            assert (want - init[name]).abs().max() > 0, name  # every A and B moved
            assert relative(a_fused[name] - init[name], want - init[name]) < 3e-4, name


def test_cpu_default_is_not_fused_and_the_config_refuses_what_cannot_fuse(tmp_path):
    tiny_llama(tmp_path)
    policy, _ = learner_steps(tmp_path, steps=1)
    assert policy.stats()["fused_lora"] is None  # auto on a CPU worker: peft's path, the default run unchanged
    assert RunConfig().learner.fused_lora == "auto"
    with pytest.raises(ValueError, match="fused_lora=true needs learner.lora.dropout=0"):
        RunConfig.model_validate({"learner": {"fused_lora": True, "lora": {"dropout": 0.1}}})
    for ok in ("auto", False):
        RunConfig.model_validate({"learner": {"fused_lora": ok, "lora": {"dropout": 0.1}}})
    with pytest.raises(ValueError, match="fused_lora=true with learner.strategy=fsdp2"):
        RunConfig.model_validate({"learner": {"fused_lora": True, "strategy": "fsdp2"}})
    RunConfig.model_validate({"learner": {"fused_lora": "auto", "strategy": "fsdp2"}})
    assert RunConfig.model_json_schema()["$defs"]["LearnerConfig"]["properties"]["fused_lora"].get("description")
