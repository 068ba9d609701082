"""Loading compressed checkpoints through transformers (quantizer registration); added with the
compressed layouts."""
