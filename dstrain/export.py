"""`python -m dstrain.export RUN_OR_CHECKPOINT [--out DIR]`: the documented command, kept where users type
it; the export itself lives in dstrain/run/export.py."""
from dstrain.run.export import main

if __name__ == "__main__":
    main()
