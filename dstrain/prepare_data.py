"""`python -m dstrain.prepare_data ...`: the corpus command of earlier releases (and of people's SLURM scripts),
kept as an alias of `python -m dstrain.data.prepare_corpus`, where it now lives. It says so once on stderr and
then does exactly what the new command does with the same arguments."""
import sys

from dstrain.data.prepare_corpus import main

if __name__ == "__main__":
    print("note: `python -m dstrain.prepare_data` is now `python -m dstrain.data.prepare_corpus` (same arguments); "
          "the old name keeps working", file=sys.stderr)
    main()
