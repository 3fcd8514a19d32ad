"""The corpus on this machine: sources found, sizes, tokenizer training and encoding time."""
import json, sys, time
from jaxspec.default_pair import corpus
from jaxspec.default_pair.train import train_tokenizer, encode_files
t = time.time(); tr, he, info = corpus.collect(corpus.source_roots()); tc = time.time() - t
texts = [x for _, x in tr]
t = time.time(); tok = train_tokenizer(texts, 4096); tt = time.time() - t
t = time.time(); ids = encode_files(tok, texts); te = time.time() - t
n = sum(len(i) for i in ids)
r = dict(collect_s=round(tc, 1), tokenizer_s=round(tt, 1), encode_s=round(te, 1), train_tokens=n,
         bytes_per_token=round(info["train_bytes"] / n, 3),
         **{k: info[k] for k in ("n_train_files", "n_heldout_files", "train_bytes", "heldout_bytes", "dropped")},
         sources={k: (v["version"], v["files"], v["bytes"]) for k, v in info["sources"].items()})
print(json.dumps(r), flush=True)
json.dump(r, open(sys.argv[1], "w"), indent=1)
