"""Every bad input gets its own clear exception, naming the argument and what was expected."""

import pytest
import torch

import kda_kcp
from kda_kcp.backend import TORCH
from kda_kcp.cuda import CudaBackend
from kda_kcp.validate import check_inputs
from helpers import make_inputs, offsets

CU = offsets([40, 30])


@pytest.fixture
def args():
    inputs, do = make_inputs(CU, H=2, K=16, V=8, dtype=torch.float32)
    return inputs, do, kda_kcp.build_context_kcp(CU)


def _call(inputs, ctx, **kw):
    return kda_kcp.chunk_kda_kcp(*inputs, ctx, **kw)


def _with(inputs, i, x):
    out = list(inputs)
    out[i] = x
    return out


def test_not_a_tensor(args):
    inputs, _, ctx = args
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        _call(_with(inputs, 0, inputs[0].tolist()), ctx)


def test_q_wrong_rank(args):
    inputs, _, ctx = args
    with pytest.raises(ValueError, match=r"q must be of shape \[T, H, K\]"):
        _call(_with(inputs, 0, inputs[0].flatten(1)), ctx)


def test_k_shape_differs_from_q(args):
    inputs, _, ctx = args
    with pytest.raises(ValueError, match="k must have the shape of q"):
        _call(_with(inputs, 1, inputs[1][:, :1].contiguous()), ctx)


def test_v_wrong_heads(args):
    inputs, _, ctx = args
    with pytest.raises(ValueError, match=r"v must be \[T, H, V\]"):
        _call(_with(inputs, 2, inputs[2][:, :1].contiguous()), ctx)


def test_g_shape(args):
    inputs, _, ctx = args
    with pytest.raises(ValueError, match="g must have the shape of q"):
        _call(_with(inputs, 3, inputs[3][:, :, :4].contiguous()), ctx)


def test_beta_shape(args):
    inputs, _, ctx = args
    with pytest.raises(ValueError, match=r"beta must be of shape \[T, H\]"):
        _call(_with(inputs, 4, inputs[4].unsqueeze(-1)), ctx)
    with pytest.raises(ValueError, match=r"beta must be \[T, H\]"):
        _call(_with(inputs, 4, inputs[4][:, :1].contiguous()), ctx)


def test_tokens_do_not_match_the_context(args):
    inputs, _, ctx = args
    short = [x[:-1].contiguous() for x in inputs]
    # one rank: the message speaks of cu_seqlens, not of shards
    with pytest.raises(ValueError, match=r"q has T = 69 tokens but the context was built from cu_seqlens ending at "
                                         r"70; cu_seqlens\[-1\] must equal T") as err:
        _call(short, ctx)
    assert "shard" not in str(err.value)
    # a rank of two: the message names this rank's share and ctx.shard
    two = kda_kcp.KcpContext(ctx.cu_seqlens, "contiguous", None, 2, 0, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"q has T = 70 tokens but rank 0 holds 35 of the context's 70 tokens; "
                                         r"pass ctx.shard\(x\)"):
        check_inputs(*inputs, two, TORCH)


def test_dtype_mismatch(args):
    inputs, _, ctx = args
    with pytest.raises(TypeError, match="k must have q's dtype"):
        _call(_with(inputs, 1, inputs[1].double()), ctx)
    with pytest.raises(TypeError, match="g must be float32"):
        _call(_with(inputs, 3, inputs[3].bfloat16()), ctx)
    with pytest.raises(TypeError, match="q must be a floating tensor"):
        _call([x.to(torch.int32) if i < 3 else x for i, x in enumerate(inputs)], ctx)
    with pytest.raises(TypeError, match="beta must be a floating tensor"):
        _call(_with(inputs, 4, inputs[4].to(torch.int64)), ctx)


def test_non_contiguous(args):
    inputs, _, ctx = args
    strided = inputs[2].transpose(0, 1).contiguous().transpose(0, 1)
    with pytest.raises(ValueError, match="v must be contiguous"):
        _call(_with(inputs, 2, strided), ctx)


def test_device_mismatch(args):
    inputs, _, ctx = args
    with pytest.raises(ValueError, match="g is on meta but q is on cpu"):
        _call(_with(inputs, 3, inputs[3].to("meta")), ctx)


@pytest.mark.parametrize("scale, exc", [(-1.0, ValueError), (float("nan"), ValueError), (0.0, ValueError), ("0.1", TypeError)])
def test_bad_scale(args, scale, exc):
    inputs, _, ctx = args
    with pytest.raises(exc, match="scale must be"):
        _call(inputs, ctx, scale=scale)


def test_a_numpy_scale_is_its_float(args):
    """A numpy scalar scale (as a model's config may hold it) is taken as the float it holds."""
    np = pytest.importorskip("numpy")
    inputs, _, ctx = args
    for scale in (np.float32(0.125), np.float64(0.125)):
        assert torch.equal(_call(inputs, ctx, scale=scale), _call(inputs, ctx, scale=0.125))


def test_ctx_and_workspace_types(args):
    inputs, _, ctx = args
    with pytest.raises(TypeError, match="ctx must be a KcpContext"):
        _call(inputs, CU)
    with pytest.raises(TypeError, match="workspace must be a WorkspaceKcp"):
        _call(inputs, ctx, workspace=torch.empty(10, dtype=torch.uint8))


def test_value_checks_on_request(args, monkeypatch):
    inputs, _, ctx = args
    hot = _with(inputs, 3, inputs[3] - 6.0)
    with pytest.raises(ValueError, match="g below -5"):  # the torch backend checks by default too (kda_kcp.status)
        _call(hot, ctx)
    with pytest.raises(ValueError, match=r"g must lie in \[-5, 0\]"):
        _call(hot, ctx, validate=True)
    with pytest.raises(ValueError, match=r"beta must lie in \[0, 2\]"):
        _call(_with(inputs, 4, inputs[4] + 2.5), ctx, validate=True)
    nan_q = inputs[0].clone()
    nan_q[3, 1, 2] = float("nan")
    with pytest.raises(ValueError, match="q holds non-finite values"):
        _call(_with(inputs, 0, nan_q), ctx, validate=True)
    monkeypatch.setenv("KDA_KCP_VALIDATE", "1")
    with pytest.raises(ValueError, match=r"g must lie in \[-5, 0\]"):
        _call(hot, ctx)
    with pytest.raises(TypeError, match="validate must be True or False"):
        _call(inputs, ctx, validate="yes")


def test_bad_grad_output(args):
    inputs, do, ctx = args
    o, saved = kda_kcp.chunk_kda_fwd_kcp(*inputs, ctx)
    with pytest.raises(ValueError, match=r"do must have the output's shape \[70, 2, 8\]"):
        kda_kcp.chunk_kda_bwd_kcp(do[:, :, :4], saved, ctx)
    with pytest.raises(TypeError, match="do must be a torch.Tensor"):
        kda_kcp.chunk_kda_bwd_kcp(None, saved, ctx)


def test_cuda_backend_rules_checked_before_any_kernel(args):
    """The CUDA backend takes BF16 q/k/v/beta, FP32 g and head dim 128 only (checked on the host)."""
    inputs, _, ctx = args
    with pytest.raises(TypeError, match="q must be torch.bfloat16 on the CUDA backend"):
        check_inputs(*inputs, ctx, CudaBackend(True))
    bf = [x.bfloat16() if i != 3 else x for i, x in enumerate(inputs)]
    with pytest.raises(ValueError, match="head dim 128 only, got K = 16, V = 8"):
        check_inputs(*bf, ctx, CudaBackend(True))


def test_gradient_checks_follow_the_forward(args, monkeypatch):
    """A forward with validate=True (or KDA_KCP_VALIDATE=1) makes its backward check do and dht too: a NaN there
    raises instead of reaching every gradient. Without it a NaN do propagates, as through any op."""
    inputs, do, ctx = args
    nan_do = do.clone()
    nan_do[5, 0, 1] = float("nan")

    def backward(grad, dht=None, **kw):
        leaves = [x.clone().requires_grad_() for x in inputs]
        o, ht = kda_kcp.chunk_kda_kcp(*leaves, ctx, output_final_state=True, **kw)
        torch.autograd.backward((o, ht), (grad, torch.zeros_like(ht) if dht is None else dht))
        return [x.grad for x in leaves]

    with pytest.raises(ValueError, match="do holds non-finite values"):
        backward(nan_do, validate=True)
    ht_shape = (ctx.num_docs, 2, 16, 8)
    with pytest.raises(ValueError, match="dht holds non-finite values"):
        backward(do, torch.full(ht_shape, float("inf")), validate=True)
    assert all(torch.isfinite(g).all() for g in backward(do, validate=True))
    assert not torch.isfinite(backward(nan_do)[0]).all()  # not asked for: NaN propagates
    _, saved = kda_kcp.chunk_kda_fwd_kcp(*inputs, ctx, validate=True)  # the explicit entries too
    with pytest.raises(ValueError, match="do holds non-finite values"):
        kda_kcp.chunk_kda_bwd_kcp(nan_do, saved, ctx)
    monkeypatch.setenv("KDA_KCP_VALIDATE", "1")
    with pytest.raises(ValueError, match="do holds non-finite values"):
        backward(nan_do)

