"""A sequence-classification fine-tune in the shape of transformers' text-classification examples: the Hugging Face
Trainer, a padding collator (each batch padded to its own longest text: dynamic shapes), an evaluation pass at the
end of every epoch. Offline: a small BERT built from its config, texts of random lengths from a fixed seed.

    python bench/scripts/trainer_finetune.py --epochs 3
"""

import argparse
import time

import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    DataCollatorWithPadding,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
)
from tokenizers import Tokenizer, models, pre_tokenizers


def tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    words = {f"w{i}": i + 4 for i in range(vocab - 4)}
    words.update({"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]")


class Texts(torch.utils.data.Dataset):
    def __init__(self, tok, n: int, seed: int, vocab: int):
        g = torch.Generator().manual_seed(seed)
        self.rows = []
        for _ in range(n):
            length = int(torch.randint(8, 120, (1,), generator=g))
            ids = torch.randint(0, vocab - 4, (length,), generator=g)
            label = int(ids.float().mean() > (vocab - 4) / 2)
            enc = tok(" ".join(f"w{i}" for i in ids.tolist()), truncation=True, max_length=128)
            self.rows.append({**enc, "labels": label})

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--train", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--out", default="finetune_out")
    args = parser.parse_args()
    started = time.perf_counter()
    torch.manual_seed(0)
    vocab = 1000
    tok = tokenizer(vocab)
    config = BertConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=256, max_position_embeddings=160, num_labels=2)
    model = BertForSequenceClassification(config)
    training_args = TrainingArguments(
        output_dir=args.out,
        num_train_epochs=args.epochs,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        learning_rate=5e-4,
        eval_strategy="epoch",
        save_strategy="no",
        logging_steps=20,
        report_to=[],
        seed=0,
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=Texts(tok, args.train, 0, vocab),
        eval_dataset=Texts(tok, 256, 1, vocab),
        data_collator=DataCollatorWithPadding(tok),
    )
    trainer.train()
    print(f"eval: {trainer.evaluate()}")
    print(f"whole run {time.perf_counter() - started:.1f}s")


if __name__ == "__main__":
    main()
