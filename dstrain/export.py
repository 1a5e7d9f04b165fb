"""`python -m dstrain.export RUN_DIR|CHECKPOINT [--out DIR]`: a Hugging Face model from any checkpoint."""
from .checkpoint import export_main

if __name__ == "__main__":
    export_main()
