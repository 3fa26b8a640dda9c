"""What train.py is built from: `data` (text, tokenizers, packing)."""
