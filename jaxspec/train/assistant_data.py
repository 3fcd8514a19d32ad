"""The assistant recipe's data (`python -m jaxspec.train.assistant`): prompts (corpus code and prose,
random token ids, the target's own samples), held-out filtering, the target's greedy continuations,
and the balanced token ordering of the ordered-embeddings head."""
from __future__ import annotations

import importlib.metadata
import re
import time

import jax.numpy as jnp
import numpy as np

import jaxspec
from jaxspec.kernels import take_rows
from jaxspec.train.shared import log


# ------------------------------------------------------------------------------------------------
# Prompts


def _docstrings(text: str, min_chars: int):
    for m in re.finditer(r'"""(.*?)"""', text, re.S):
        s = m.group(1).strip()
        if len(s) >= min_chars and sum(c.isalpha() or c == " " for c in s) >= 0.75 * len(s):
            yield s


def _metadata_texts():
    """(name, description) of every installed distribution's METADATA body (its long description)."""
    out = []
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: (d.metadata["Name"] or "").lower()):
        name = dist.metadata["Name"] or "?"
        body = dist.metadata.get_payload() if hasattr(dist.metadata, "get_payload") else None
        if isinstance(body, str) and len(body) > 400:
            out.append((f"metadata/{name.lower()}", body))
    return out


def corpus_texts(max_files: int | None = None):
    """(code [(name, text)], prose [(name, text)], info) from the training split of
    jaxspec.train.corpus (held-out files excluded by its name rule) plus METADATA prose."""
    from jaxspec.train import corpus
    train, _held, info = corpus.collect(corpus.source_roots(corpus.PACKAGES), max_files)
    prose = []
    for name, text in train:
        for i, s in enumerate(_docstrings(text, 300)):
            prose.append((f"{name}#doc{i}", s))
    prose += [(n, t) for n, t in _metadata_texts() if not corpus.is_heldout(n)]
    return train, prose, dict(code_files=len(train), prose_texts=len(prose), python=info["python"],
                              corpus_train_sha256=info["train_sha256"])


def heldout_probes(prompts: list[dict]) -> list[str]:
    """Snippets of each held-out prompt: a training text containing one is dropped."""
    probes = []
    for p in prompts:
        t = " ".join(p["text"].split())
        for a in range(0, max(1, len(t) - 40), 60):
            probes.append(t[a:a + 40])
    return [p for p in probes if len(p) >= 20]


def drop_heldout(texts, probes):
    """texts without those containing a held-out probe (whitespace-normalised) -> (kept, dropped names)."""
    kept, dropped = [], []
    for name, t in texts:
        flat = " ".join(t.split())
        if any(p in flat for p in probes):
            dropped.append(name)
        else:
            kept.append((name, t))
    return kept, dropped


def text_prompts(tok, code, prose, n: int, length: int, seed: int) -> np.ndarray:
    """n prompts of `length` tokens (BOS first, from tok.encode), alternately code and prose windows
    starting at a line (code) or sentence (prose) boundary at a random offset of a random text."""
    rng = np.random.default_rng(seed)
    out = []
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 50 * n:
            raise RuntimeError(f"only {len(out)} of {n} prompts of {length} tokens found in the texts")
        pool = code if len(out) % 2 == 0 or not prose else prose
        _, text = pool[rng.integers(len(pool))]
        start = int(rng.integers(0, max(1, len(text) - 200)))
        cut = text.find("\n" if pool is code else ". ", start)
        start = start if cut < 0 else cut + (1 if pool is code else 2)
        snippet = text[start:start + 8 * length]
        if pool is not code:
            snippet = " ".join(snippet.split())
        ids = tok.encode(snippet)
        if len(ids) >= length and len(snippet.strip()) > 20:
            out.append(ids[:length])
    return np.asarray(out, np.int32)


def random_prompts(vocab: int, n: int, length: int, seed: int, avoid=()) -> np.ndarray:
    """Random token prompts (ids 3..vocab-1: no pad/eos/bos), none equal to a row of `avoid`."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(3, vocab, (n, length)).astype(np.int32)
    bad = {tuple(r) for r in np.asarray(avoid).reshape(-1, length)} if len(avoid) else set()
    return np.asarray([r for r in rows if tuple(r) not in bad], np.int32)


def self_prompts(target, bos: int, n: int, length: int, batch: int, temperature: float, seed: int,
                 bad_ids=(), end_by: float | None = None) -> np.ndarray:
    """n prompts of `length` tokens the target writes itself: BOS, then length-1 tokens sampled from it
    (`temperature`, top_p 0.95; one seed per batch call, so the batch's rows differ). Text of the kind
    the target was trained on (general web prose, stories, letters, lists), which the corpus (code,
    docstrings, package descriptions) lacks. Rows holding one of `bad_ids` (EOS, pad: the text ended
    and what follows is not a continuation) are dropped, and batches are drawn until n remain, or
    until `end_by` (time.time()) has passed after a batch that kept rows (then fewer than n)."""
    out, call = [], 0
    while sum(len(r) for r in out) < n:
        if end_by is not None and sum(len(r) for r in out) and time.time() > end_by:
            log(f"self-written prompts: time is up after {sum(len(r) for r in out)} of {n}")
            break
        if call > 4 * (n // batch + 1):
            raise RuntimeError(f"only {sum(len(r) for r in out)} of {n} self-written prompts without EOS")
        r = jaxspec.generate(target, [[bos]] * batch, max_new_tokens=length - 1, temperature=temperature,
                             top_p=0.95, seed=seed * 100003 + call, eos_token_ids=[])
        call += 1
        rows = np.asarray([[bos] + x[:length - 1] for x in r.tokens], np.int32)
        out.append(rows[~np.isin(rows[:, 1:], np.asarray(list(bad_ids) or [-1])).any(axis=1)])
    return np.concatenate(out)[:n]


# ------------------------------------------------------------------------------------------------
# Greedy data and the token ordering


def greedy_rows(target, prompts: np.ndarray, new_tokens: int, batch: int, end_by: float) -> np.ndarray:
    """[M, P + new_tokens]: each prompt and the target's greedy continuation (jaxspec.generate,
    classic, no stop tokens), whole batches only, stopping when `end_by` (time.time()) has passed."""
    rows = []
    for i in range(0, len(prompts) - batch + 1, batch):
        if rows and time.time() > end_by:
            log(f"greedy data: time is up after {len(rows) * batch} rows")
            break
        t = time.time()
        part = prompts[i:i + batch]
        r = jaxspec.generate(target, part.tolist(), max_new_tokens=new_tokens, block_size=1, eos_token_ids=[])
        gen = np.asarray([x[:new_tokens] for x in r.tokens], np.int32)
        if gen.shape != (len(part), new_tokens):
            raise RuntimeError(f"greedy generation returned {gen.shape}, expected {(len(part), new_tokens)}")
        rows.append(np.concatenate([part, gen], axis=1))
        if i == 0 or (i // batch) % 8 == 0:
            log(f"greedy data: {i + batch}/{len(prompts)} rows ({time.time() - t:.1f}s for {batch})")
    if not rows:
        raise RuntimeError("no greedy rows generated")
    return np.concatenate(rows, axis=0)


def embedding_table(target) -> np.ndarray:
    """The target's embedding rows, float32 [V, H] on the host."""
    e = target.params["embed_tokens"]
    v = target.config.vocab_size
    chunks = [np.asarray(take_rows(e, jnp.arange(i, min(v, i + 32768), dtype=jnp.int32), jnp.float32))
              for i in range(0, v, 32768)]
    return np.concatenate(chunks, axis=0)


def balanced_ordering(table, n_clusters: int, dims: int = 32, iters: int = 6, seed: int = 0):
    """-> (ordering [V] int32, centroids [n, H] float32): cluster c is ordering[c*V/n:(c+1)*V/n], the
    groups of a recursive split of the rows at the median of their projection on the group's top
    principal axis (power iteration), so every cluster has V/n rows; centroids are the mean rows.
    The splits work in the table's top `dims` principal components (from an SVD of a sample of
    rows): every level then moves V x dims floats, not the whole table (numpy, any machine)."""
    x = np.asarray(table, np.float32)
    v, h = x.shape
    if n_clusters & (n_clusters - 1) or v % n_clusters:
        raise ValueError(f"num_centroids={n_clusters} must be a power of two dividing the vocabulary {v}")
    rng = np.random.default_rng(seed)
    sample = x[np.sort(rng.choice(v, min(v, 16384), replace=False))]
    mean = sample.mean(axis=0)
    _, _, vt = np.linalg.svd(sample - mean, full_matrices=False)
    w = vt[:min(dims, h)].T
    z = x @ w - mean @ w  # [V, dims]
    perm = np.arange(v, dtype=np.int64)[None]
    while perm.shape[0] < n_clusters:
        g, n = perm.shape
        zs = z[perm]
        zs -= zs.mean(axis=1, keepdims=True)
        d = rng.standard_normal((g, zs.shape[2])).astype(np.float32)
        for _ in range(iters):
            d = np.einsum("gnd,gn->gd", zs, np.einsum("gnd,gd->gn", zs, d))
            d /= np.maximum(np.linalg.norm(d, axis=1, keepdims=True), 1e-30)
        order = np.argsort(np.einsum("gnd,gd->gn", zs, d), axis=1, kind="stable")
        perm = np.take_along_axis(perm, order, axis=1).reshape(2 * g, n // 2)
    ordering = perm.reshape(-1).astype(np.int32)
    cents = np.stack([x[c].mean(axis=0) for c in perm]).astype(np.float32)
    return ordering, cents
