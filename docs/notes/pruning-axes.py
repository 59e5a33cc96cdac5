"""Side run: the pruning experiment's recipe (bench --only pruning, cpu workload) at depth_share 0 and 1."""
import json, sys, time
sys.path.insert(0, "/work/main")
import torch
import prune
from engine import LLM
from model import load_model, default_model_path
from support.calibration import calibration_ids
from experiments.common import eval_text
from experiments.quantization import perplexity
path = default_model_path()
teacher, cfg = load_model(path)
llm = LLM(path, max_num_seqs=16)
tok = llm.tokenizer
ev, calib = tok.encode(eval_text()), calibration_ids(tok, 1024)
scores = prune.importance(teacher, calib)
texts = prune.teacher_texts(llm, 96, 128)
del llm
out = {}
for depth in (0.0, 1.0):
    shape = prune.target_shape(cfg, 0.7, depth)
    st = prune.cut(teacher, scores, shape)
    cutp = perplexity(st, ev)
    t = time.time()
    losses = prune.distill(st, teacher, texts, 300, 1e-4, log=lambda s: None)
    out[depth] = dict(layers=shape.n_layers, ffn=shape.ffn_dim, params=prune.n_params(shape), cut=cutp,
                      distilled=perplexity(st, ev), seconds=time.time() - t, kl=[losses[0], losses[-1]])
    print(depth, out[depth], flush=True)
json.dump(out, open("/tmp/axes/out.json", "w"), indent=1)
