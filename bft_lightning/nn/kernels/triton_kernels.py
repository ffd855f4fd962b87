"""The fused kriging kernel's Triton functions: forward, dK/dV/dbias and dQ.

Defined on first use by :func:`define_kernels` (Triton is optional and its
interpreter mode is fixed when it is imported); launched, JIT-compiled or
interpreted, by ``fused_triton``. The algorithm and the arguments are those of
``blockwise`` (one pass over key blocks with an online softmax; the backward
recomputes each block), ``docs/performance.md``.
"""

# ruff: noqa: N803, N806  (Triton's convention: upper-case pointer and block names)

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

tl: Any = None  # triton.language, set by define_kernels

__all__ = ["define_kernels"]


def define_kernels() -> SimpleNamespace:
    """The kernels' Python functions (Triton imported first: their annotations read it)."""
    global tl
    import triton.language as tl_module

    tl = tl_module

    def _fwd_kernel(
        Q, K, V, BIAS, ALLOWED, KVALID, SEED,
        EST, M2, PSQ, LSE, OUT,
        sqb, sqh, sqt, sqd,
        skb, skh, sks, skd,
        svb, svh, svs, svd,
        sbb, sbh, sbs,
        sab, sat, sas,
        skvb, skvs,
        H, T, S, DH, DV, SCAL, threshold,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_DH: tl.constexpr, BLOCK_DV: tl.constexpr,
        HAS_BIAS: tl.constexpr, HAS_ALLOWED: tl.constexpr, HAS_KVALID: tl.constexpr,
        CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, ACC: tl.constexpr,
    ):  # fmt: skip
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        hh = bh % H
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_DH)
        offs_v = tl.arange(0, BLOCK_DV)
        row_ok = offs_m < T
        q = tl.load(
            Q + b * sqb + hh * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd,
            mask=row_ok[:, None] & (offs_d[None, :] < DH), other=0.0,
        ).to(ACC)  # fmt: skip
        q = q * tl.load(SCAL).to(ACC)  # SCAL: [1 / sqrt(d_h), dropout factor]
        mu = tl.full([BLOCK_M], float("-inf"), ACC)
        l_sum = tl.zeros([BLOCK_M], ACC)
        p2_sum = tl.zeros([BLOCK_M], ACC)
        m2_sum = tl.zeros([BLOCK_M], ACC)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], ACC)
        acc_o = tl.zeros([BLOCK_M, BLOCK_DV], ACC)
        stream = tl.zeros([1], tl.int64)
        if DROPOUT:
            x = (tl.load(SEED).to(tl.int64) + bh.to(tl.int64) * 0x9E3779B9) & 0xFFFFFFFF
            x = x ^ (x >> 16)
            x = (x * 0x21F0AAAD) & 0xFFFFFFFF
            x = x ^ (x >> 15)
            x = (x * 0x735A2D97) & 0xFFFFFFFF
            stream = x ^ (x >> 15)
        hi = S
        if CAUSAL:
            hi = tl.minimum(S, (pid_m + 1) * BLOCK_M)
        for start_n in range(0, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            col_ok = offs_n < S
            k = tl.load(
                K + b * skb + hh * skh + offs_n[None, :] * sks + offs_d[:, None] * skd,
                mask=col_ok[None, :] & (offs_d[:, None] < DH), other=0.0,
            ).to(ACC)  # (BLOCK_DH, BLOCK_N)  # fmt: skip
            s = tl.dot(q, k, input_precision="ieee", out_dtype=ACC)
            if HAS_BIAS:
                bias = tl.load(BIAS + b * sbb + hh * sbh + offs_n * sbs, mask=col_ok, other=0.0)
                s = s + bias.to(ACC)[None, :]
            ok = col_ok[None, :] & row_ok[:, None]
            if HAS_ALLOWED:
                a = tl.load(
                    ALLOWED + b * sab + offs_m[:, None] * sat + offs_n[None, :] * sas,
                    mask=ok, other=0,
                )  # fmt: skip
                ok = ok & (a != 0)
            if HAS_KVALID:
                kv = tl.load(KVALID + b * skvb + offs_n * skvs, mask=col_ok, other=0)
                ok = ok & (kv != 0)[None, :]
            if CAUSAL:
                ok = ok & (offs_n[None, :] <= offs_m[:, None])
            s = tl.where(ok, s, float("-inf"))
            mu_new = tl.maximum(mu, tl.max(s, 1))
            mu_safe = tl.where(mu_new == float("-inf"), 0.0, mu_new)
            alpha = tl.exp(mu - mu_safe)
            p = tl.exp(s - mu_safe[:, None])
            l_sum = l_sum * alpha + tl.sum(p, 1)
            p2_sum = p2_sum * alpha * alpha + tl.sum(p * p, 1)
            v = tl.load(
                V + b * svb + hh * svh + offs_n[:, None] * svs + offs_v[None, :] * svd,
                mask=col_ok[:, None] & (offs_v[None, :] < DV), other=0.0,
            ).to(ACC)  # (BLOCK_N, BLOCK_DV)  # fmt: skip
            vsq = tl.sum(v * v, 1) / DV
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee", out_dtype=ACC)
            m2_sum = m2_sum * alpha + tl.sum(p * vsq[None, :], 1)
            if DROPOUT:
                pos = (offs_m[:, None].to(tl.int64) * S + offs_n[None, :]) & 0xFFFFFFFF
                x = pos ^ stream
                x = x ^ (x >> 16)
                x = (x * 0x21F0AAAD) & 0xFFFFFFFF
                x = x ^ (x >> 15)
                x = (x * 0x735A2D97) & 0xFFFFFFFF
                x = x ^ (x >> 15)
                kept = tl.where((x >> 16) < threshold, p, 0.0)
                acc_o = acc_o * alpha[:, None] + tl.dot(
                    kept, v, input_precision="ieee", out_dtype=ACC
                )
            mu = mu_new
        has = l_sum > 0
        inv = tl.where(has, 1.0 / tl.where(has, l_sum, 1.0), 0.0)
        rows = bh * T + offs_m
        tl.store(M2 + rows, m2_sum * inv, mask=row_ok)
        tl.store(PSQ + rows, p2_sum * inv * inv, mask=row_ok)
        lse = tl.where(has, mu + tl.log(tl.where(has, l_sum, 1.0)), float("inf"))
        tl.store(LSE + rows, lse, mask=row_ok)
        out_ptr = rows[:, None] * DV + offs_v[None, :]
        out_ok = row_ok[:, None] & (offs_v[None, :] < DV)
        tl.store(EST + out_ptr, acc * inv[:, None], mask=out_ok)
        if DROPOUT:
            tl.store(OUT + out_ptr, acc_o * (inv * tl.load(SCAL + 1).to(ACC))[:, None], mask=out_ok)

    def _bwd_dkdv_kernel(
        Q, K, V, BIAS, ALLOWED, KVALID, SEED,
        GE, GM, GP2, GO, C, LSE,
        DK, DVV, DB,
        sqb, sqh, sqt, sqd,
        skb, skh, sks, skd,
        svb, svh, svs, svd,
        sbb, sbh, sbs,
        sab, sat, sas,
        skvb, skvs,
        H, T, S, DH, DV, SCAL, threshold,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_DH: tl.constexpr, BLOCK_DV: tl.constexpr,
        HAS_BIAS: tl.constexpr, HAS_ALLOWED: tl.constexpr, HAS_KVALID: tl.constexpr,
        CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, ACC: tl.constexpr,
    ):  # fmt: skip
        pid_n = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        hh = bh % H
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_DH)
        offs_v = tl.arange(0, BLOCK_DV)
        col_ok = offs_n < S
        k = tl.load(
            K + b * skb + hh * skh + offs_n[:, None] * sks + offs_d[None, :] * skd,
            mask=col_ok[:, None] & (offs_d[None, :] < DH), other=0.0,
        ).to(ACC)  # (BLOCK_N, BLOCK_DH)  # fmt: skip
        v = tl.load(
            V + b * svb + hh * svh + offs_n[:, None] * svs + offs_v[None, :] * svd,
            mask=col_ok[:, None] & (offs_v[None, :] < DV), other=0.0,
        ).to(ACC)  # (BLOCK_N, BLOCK_DV)  # fmt: skip
        vsq = tl.sum(v * v, 1) / DV
        bias = tl.zeros([BLOCK_N], ACC)
        if HAS_BIAS:
            bias = tl.load(BIAS + b * sbb + hh * sbh + offs_n * sbs, mask=col_ok, other=0.0)
            bias = bias.to(ACC)
        kv_ok = col_ok
        if HAS_KVALID:
            kv = tl.load(KVALID + b * skvb + offs_n * skvs, mask=col_ok, other=0)
            kv_ok = kv_ok & (kv != 0)
        stream = tl.zeros([1], tl.int64)
        if DROPOUT:
            x = (tl.load(SEED).to(tl.int64) + bh.to(tl.int64) * 0x9E3779B9) & 0xFFFFFFFF
            x = x ^ (x >> 16)
            x = (x * 0x21F0AAAD) & 0xFFFFFFFF
            x = x ^ (x >> 15)
            x = (x * 0x735A2D97) & 0xFFFFFFFF
            stream = x ^ (x >> 15)
        dk = tl.zeros([BLOCK_N, BLOCK_DH], ACC)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], ACC)
        dvsq = tl.zeros([BLOCK_N], ACC)
        db = tl.zeros([BLOCK_N], ACC)
        lo = 0
        if CAUSAL:
            lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M
        for start_m in range(lo, T, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            row_ok = offs_m < T
            rows = bh * T + offs_m
            q = tl.load(
                Q + b * sqb + hh * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd,
                mask=row_ok[:, None] & (offs_d[None, :] < DH), other=0.0,
            ).to(ACC)  # fmt: skip
            q = q * tl.load(SCAL).to(ACC)
            s = tl.dot(q, tl.trans(k), input_precision="ieee", out_dtype=ACC) + bias[None, :]
            ok = row_ok[:, None] & kv_ok[None, :]
            if HAS_ALLOWED:
                a = tl.load(
                    ALLOWED + b * sab + offs_m[:, None] * sat + offs_n[None, :] * sas,
                    mask=ok, other=0,
                )  # fmt: skip
                ok = ok & (a != 0)
            if CAUSAL:
                ok = ok & (offs_n[None, :] <= offs_m[:, None])
            lse = tl.load(LSE + rows, mask=row_ok, other=float("inf"))
            p = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)
            ge = tl.load(
                GE + rows[:, None] * DV + offs_v[None, :],
                mask=row_ok[:, None] & (offs_v[None, :] < DV), other=0.0,
            )  # fmt: skip
            gm = tl.load(GM + rows, mask=row_ok, other=0.0)
            gp2 = tl.load(GP2 + rows, mask=row_ok, other=0.0)
            c = tl.load(C + rows, mask=row_ok, other=0.0)
            grad = tl.dot(ge, tl.trans(v), input_precision="ieee", out_dtype=ACC)
            grad = grad + gm[:, None] * vsq[None, :] + gp2[:, None] * p
            if DROPOUT:
                pos = (offs_m[:, None].to(tl.int64) * S + offs_n[None, :]) & 0xFFFFFFFF
                x = pos ^ stream
                x = x ^ (x >> 16)
                x = (x * 0x21F0AAAD) & 0xFFFFFFFF
                x = x ^ (x >> 15)
                x = (x * 0x735A2D97) & 0xFFFFFFFF
                x = x ^ (x >> 15)
                keep = (x >> 16) < threshold
                go = tl.load(
                    GO + rows[:, None] * DV + offs_v[None, :],
                    mask=row_ok[:, None] & (offs_v[None, :] < DV), other=0.0,
                )  # fmt: skip
                from_out = tl.dot(go, tl.trans(v), input_precision="ieee", out_dtype=ACC)
                grad = grad + tl.where(keep, from_out, 0.0)
                kept = tl.where(keep, p, 0.0)
                dv += tl.dot(tl.trans(kept), go, input_precision="ieee", out_dtype=ACC)
            ds = p * (grad - c[:, None])
            dk += tl.dot(tl.trans(ds), q, input_precision="ieee", out_dtype=ACC)
            dv += tl.dot(tl.trans(p), ge, input_precision="ieee", out_dtype=ACC)
            dvsq += tl.sum(p * gm[:, None], 0)
            db += tl.sum(ds, 0)
        dv = dv + dvsq[:, None] * 2.0 * v / DV
        cols = bh * S + offs_n
        tl.store(
            DK + cols[:, None] * DH + offs_d[None, :], dk,
            mask=col_ok[:, None] & (offs_d[None, :] < DH),
        )  # fmt: skip
        tl.store(
            DVV + cols[:, None] * DV + offs_v[None, :], dv,
            mask=col_ok[:, None] & (offs_v[None, :] < DV),
        )  # fmt: skip
        if HAS_BIAS:
            tl.store(DB + cols, db, mask=col_ok)

    def _bwd_dq_kernel(
        Q, K, V, BIAS, ALLOWED, KVALID, SEED,
        GE, GM, GP2, GO, C, LSE,
        DQ,
        sqb, sqh, sqt, sqd,
        skb, skh, sks, skd,
        svb, svh, svs, svd,
        sbb, sbh, sbs,
        sab, sat, sas,
        skvb, skvs,
        H, T, S, DH, DV, SCAL, threshold,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_DH: tl.constexpr, BLOCK_DV: tl.constexpr,
        HAS_BIAS: tl.constexpr, HAS_ALLOWED: tl.constexpr, HAS_KVALID: tl.constexpr,
        CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, ACC: tl.constexpr,
    ):  # fmt: skip
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        hh = bh % H
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_DH)
        offs_v = tl.arange(0, BLOCK_DV)
        row_ok = offs_m < T
        rows = bh * T + offs_m
        q = tl.load(
            Q + b * sqb + hh * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd,
            mask=row_ok[:, None] & (offs_d[None, :] < DH), other=0.0,
        ).to(ACC)  # fmt: skip
        q = q * tl.load(SCAL).to(ACC)
        vrow_ok = row_ok[:, None] & (offs_v[None, :] < DV)
        ge = tl.load(GE + rows[:, None] * DV + offs_v[None, :], mask=vrow_ok, other=0.0)
        gm = tl.load(GM + rows, mask=row_ok, other=0.0)
        gp2 = tl.load(GP2 + rows, mask=row_ok, other=0.0)
        c = tl.load(C + rows, mask=row_ok, other=0.0)
        lse = tl.load(LSE + rows, mask=row_ok, other=float("inf"))
        go = tl.zeros([BLOCK_M, BLOCK_DV], ACC)
        stream = tl.zeros([1], tl.int64)
        if DROPOUT:
            go = tl.load(GO + rows[:, None] * DV + offs_v[None, :], mask=vrow_ok, other=0.0)
            x = (tl.load(SEED).to(tl.int64) + bh.to(tl.int64) * 0x9E3779B9) & 0xFFFFFFFF
            x = x ^ (x >> 16)
            x = (x * 0x21F0AAAD) & 0xFFFFFFFF
            x = x ^ (x >> 15)
            x = (x * 0x735A2D97) & 0xFFFFFFFF
            stream = x ^ (x >> 15)
        dq = tl.zeros([BLOCK_M, BLOCK_DH], ACC)
        hi = S
        if CAUSAL:
            hi = tl.minimum(S, (pid_m + 1) * BLOCK_M)
        for start_n in range(0, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            col_ok = offs_n < S
            k = tl.load(
                K + b * skb + hh * skh + offs_n[:, None] * sks + offs_d[None, :] * skd,
                mask=col_ok[:, None] & (offs_d[None, :] < DH), other=0.0,
            ).to(ACC)  # (BLOCK_N, BLOCK_DH)  # fmt: skip
            v = tl.load(
                V + b * svb + hh * svh + offs_n[:, None] * svs + offs_v[None, :] * svd,
                mask=col_ok[:, None] & (offs_v[None, :] < DV), other=0.0,
            ).to(ACC)  # (BLOCK_N, BLOCK_DV)  # fmt: skip
            vsq = tl.sum(v * v, 1) / DV
            s = tl.dot(q, tl.trans(k), input_precision="ieee", out_dtype=ACC)
            if HAS_BIAS:
                bias = tl.load(BIAS + b * sbb + hh * sbh + offs_n * sbs, mask=col_ok, other=0.0)
                s = s + bias.to(ACC)[None, :]
            ok = row_ok[:, None] & col_ok[None, :]
            if HAS_ALLOWED:
                a = tl.load(
                    ALLOWED + b * sab + offs_m[:, None] * sat + offs_n[None, :] * sas,
                    mask=ok, other=0,
                )  # fmt: skip
                ok = ok & (a != 0)
            if HAS_KVALID:
                kv = tl.load(KVALID + b * skvb + offs_n * skvs, mask=col_ok, other=0)
                ok = ok & (kv != 0)[None, :]
            if CAUSAL:
                ok = ok & (offs_n[None, :] <= offs_m[:, None])
            p = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)
            grad = tl.dot(ge, tl.trans(v), input_precision="ieee", out_dtype=ACC)
            grad = grad + gm[:, None] * vsq[None, :] + gp2[:, None] * p
            if DROPOUT:
                pos = (offs_m[:, None].to(tl.int64) * S + offs_n[None, :]) & 0xFFFFFFFF
                x = pos ^ stream
                x = x ^ (x >> 16)
                x = (x * 0x21F0AAAD) & 0xFFFFFFFF
                x = x ^ (x >> 15)
                x = (x * 0x735A2D97) & 0xFFFFFFFF
                x = x ^ (x >> 15)
                from_out = tl.dot(go, tl.trans(v), input_precision="ieee", out_dtype=ACC)
                grad = grad + tl.where((x >> 16) < threshold, from_out, 0.0)
            ds = p * (grad - c[:, None])
            dq += tl.dot(ds, k, input_precision="ieee", out_dtype=ACC)
        tl.store(
            DQ + rows[:, None] * DH + offs_d[None, :], dq * tl.load(SCAL).to(ACC),
            mask=row_ok[:, None] & (offs_d[None, :] < DH),
        )  # fmt: skip

    return SimpleNamespace(fwd=_fwd_kernel, dkdv=_bwd_dkdv_kernel, dq=_bwd_dq_kernel)
