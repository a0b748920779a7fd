"""Task data built from a corpus: instruction pairs for supervised fine-tuning."""
