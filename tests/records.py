"""Decoders of the CUDA backward's scratch layouts (csrc/kda_bwd.h) for the tests that read a record, h or dh:
the emulated kernels' (tests/test_kernel_emulation.py) and the GPU's (tests/gpu/test_bwd_cuda.py). The package
carves by the sizes in kda_kcp.cuda.bwd_layout and reads none of these.
"""

from __future__ import annotations

import torch

_D = 128  # the kernels' head dim (K = V)
REC_VN, REC_DVN = 81920, 131584  # byte offsets of the walks' V_new (over U) and dV_new; kda_bwd.h kRecVn, kRecDvn
VN_SCALE_OFF = 640  # their powers of two inside the slot; kda_bwd.h kVnScaleOff
DH_SCALE_OFF = 32768  # the powers of two of dh per chunk-head; kda_bwd.h kDhScaleOff
REC_U, U_SCALE_OFF = 81920, 128  # the prep's U (fp16, scaled) and its scale; kda_bwd.h kRecU, kUScaleOff


def record_lower_blocks(device="cpu") -> torch.Tensor:
    """[64][64] bool, True on the 16 x 16 blocks (I, J <= I) of a record's Aqk, A and P that the prep writes: the
    strictly upper blocks stay unwritten (kda_bwd.h), so a reader of a record must mask them."""
    b = torch.arange(64, device=device) // 16
    return b[None, :] <= b[:, None]


def walk_tiles(records: torch.Tensor, offset: int) -> torch.Tensor:
    """V_new (``offset`` REC_VN) or dV_new (REC_DVN) as fp32 [N, H, 64 tokens, 128] from prep records
    [N, H, PREP_BYTES] uint8 after the walks. The walks' fragment order (kda_bwd.h):
    64 rows of 512 bytes, row 16 w + 4 ks + 2 ih + il, at byte 256 z the fp16 words of the 32 lanes (4 g + l); a
    word holds tokens 16 ks + 8 ih + 2 l (+1) of value column 64 z + 16 w + 8 il + g, times 2^-e of (z, w); 2^e as
    fp32 at byte VN_SCALE_OFF + 256 z + 4 w."""
    n, H = records.shape[:2]
    x = records[:, :, offset : offset + 32768].contiguous().view(torch.float16).float()
    x = x.reshape(n, H, 4, 4, 2, 2, 2, 2, 8, 4, 2)[:, :, :, :, :, :, :, 0]  # [n, H, w, ks, ih, il, z, g, l, e]
    sc = records[:, :, offset + VN_SCALE_OFF : offset + VN_SCALE_OFF + 512].contiguous().view(torch.float32)
    sc = sc.reshape(n, H, 2, 64)[..., :4]  # [n, H, z, w]
    x = x * sc.permute(0, 1, 3, 2)[:, :, :, None, None, None, :, None, None, None]
    return x.permute(0, 1, 3, 4, 8, 9, 6, 2, 5, 7).reshape(n, H, 64, _D)


def record_u(records: torch.Tensor) -> torch.Tensor:
    """U = A diag(beta) V as fp32 [N, H, 64, 128] from prep records [N, H, PREP_BYTES] uint8 before the forward
    walk writes V_new over it. kda_bwd.h: row i, value half z as 64 fp16 at byte 512 i + 256 z of the slot, times the chunk-head's power of two 2^e, an fp32 at byte 128 of the slot."""
    n, H = records.shape[:2]
    u = records[:, :, REC_U : REC_U + 32768].reshape(n, H, 64, 2, 256)[..., :128]
    u = u.contiguous().view(torch.float16).float().reshape(n, H, 64, _D)
    scale = records[:, :, REC_U + U_SCALE_OFF : REC_U + U_SCALE_OFF + 4].contiguous().view(torch.float32)
    return u * scale[..., None]


def scaled_states(x: torch.Tensor) -> torch.Tensor:
    """The states S[key][value] as fp32 [n, H, 128, 128] from dh (``bwd_layout.scaled_state_shape``). Per
    chunk-head, kda_bwd.h: value half z, warp w, key step nt, eh, then 32 lanes (4 g + l) of fp16 words of two
    adjacent keys 8 nt + 2 l (+1) of value column 64 z + 16 w + 8 eh + g, times 2^-e of (z, w); then
    2^e as fp32 at byte DH_SCALE_OFF + 16 z + 4 w."""
    n, H = x.shape[:2]
    y = x[:, :, :DH_SCALE_OFF].contiguous().view(torch.float16).float().reshape(n, H, 2, 4, 16, 2, 8, 4, 2)
    sc = x[:, :, DH_SCALE_OFF : DH_SCALE_OFF + 32].contiguous().view(torch.float32).reshape(n, H, 2, 4)
    y = y * sc[:, :, :, :, None, None, None, None, None]
    return y.permute(0, 1, 4, 7, 8, 2, 3, 5, 6).reshape(n, H, _D, _D)  # [n, H, (nt, l, e), (z, w, eh, g)]


def hi_states(x: torch.Tensor) -> torch.Tensor:
    """The states S[key][value] as fp32 [n, H, 128, 128] from h (``bwd_layout.hi_state_shape``):
    the order of ``scaled_states``, bf16 words and no powers."""
    n, H = x.shape[:2]
    y = x.contiguous().view(torch.bfloat16).float().reshape(n, H, 2, 4, 16, 2, 8, 4, 2)
    return y.permute(0, 1, 4, 7, 8, 2, 3, 5, 6).reshape(n, H, _D, _D)  # [n, H, (nt, l, e), (z, w, eh, g)]
