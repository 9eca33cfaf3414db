"""Local stand-ins for what huggingface/accelerate's examples/nlp_example.py downloads, so that it runs offline.

Run in the folder that holds nlp_example.py (transformers, datasets and evaluate installed):

    python accelerate_offline.py
    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 python nlp_example.py --cpu

It writes ./bert-base-cased (a 4-layer, 128-wide BERT with random weights and a 305-word vocabulary: from_pretrained
reads a local folder of that name first), ./nyu-mll/glue (MRPC's columns and splits as CSV: load_dataset reads a
local folder first) and ./glue/glue.py (the accuracy and F1 that evaluate.load("glue", "mrpc") computes). The
sentence pairs are random words; a pair is a paraphrase when it holds the same words.
"""

import csv
import os
import random

import torch
from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

random.seed(0)
torch.manual_seed(0)
words = [f"w{i}" for i in range(300)]
os.makedirs("bert-base-cased", exist_ok=True)
with open("bert-base-cased/vocab.txt", "w") as f:
    f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words) + "\n")
tok = BertTokenizer("bert-base-cased/vocab.txt", do_lower_case=False)
tok.save_pretrained("bert-base-cased")
cfg = BertConfig(vocab_size=len(words) + 5, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                 intermediate_size=512, max_position_embeddings=128)
BertForSequenceClassification(cfg).save_pretrained("bert-base-cased")
os.makedirs("nyu-mll/glue/mrpc", exist_ok=True)
with open("nyu-mll/glue/README.md", "w") as f:
    f.write("---\nconfigs:\n- config_name: mrpc\n  data_files:\n  - split: train\n    path: mrpc/train.csv\n"
            "  - split: validation\n    path: mrpc/validation.csv\n  - split: test\n    path: mrpc/test.csv\n---\n")
for split, n in (("train", 1280), ("validation", 160), ("test", 160)):
    with open(f"nyu-mll/glue/mrpc/{split}.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["sentence1", "sentence2", "label", "idx"])
        for i in range(n):
            a = [random.choice(words) for _ in range(random.randint(8, 30))]
            same = random.random() < 0.5
            b = a[:] if same else [random.choice(words) for _ in range(len(a))]
            random.shuffle(b)
            w.writerow([" ".join(a), " ".join(b), int(same), i])

os.makedirs("glue", exist_ok=True)
with open("glue/glue.py", "w") as f:
    f.write('''import datasets
import evaluate


class Glue(evaluate.Metric):
    def _info(self):
        features = datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")})
        return evaluate.MetricInfo(description="glue mrpc", citation="", inputs_description="", features=features)

    def _compute(self, predictions, references):
        pairs = list(zip(predictions, references))
        tp = sum(p == r == 1 for p, r in pairs)
        fp = sum(p == 1 and r == 0 for p, r in pairs)
        fn = sum(p == 0 and r == 1 for p, r in pairs)
        return {"accuracy": sum(p == r for p, r in pairs) / len(pairs), "f1": 2 * tp / max(2 * tp + fp + fn, 1)}
''')
