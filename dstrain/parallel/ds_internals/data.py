"""Hugging Face datasets' private fingerprint of a dataset."""
from __future__ import annotations


def dataset_fingerprint(dataset) -> str:
    """The datasets library's content fingerprint of a Dataset (changes when its files or transforms do):
    Dataset._fingerprint; no public accessor exists."""
    return dataset._fingerprint
