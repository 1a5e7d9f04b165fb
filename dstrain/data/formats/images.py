"""Rows with images for a vision-language model (issue 86; the model side is dstrain/vision.py): conversations whose
messages hold `{"type": "image"}` parts and whose row names the images (TRL's vision layout: an `images` column).

The conversation is rendered once by the chat template and its assistant spans found as for text (sft.py:
assistant_spans); the text before, between and after the spans is tokenized piece by piece as there, except that a
piece holding image placeholders goes through the model's processor with its images, which expands each placeholder
into the model's image tokens and gives the pixels. Image tokens lie in the prompt's pieces, so the loss never falls
on them. What the processor gives per image (pixel_values, image sizes or grids) is kept per row and concatenated over
a micro-batch; what it gives per token (Gemma 3's token_type_ids: image tokens attend to each other both ways) is
padded as the attention mask is.

Written here, not taken from TRL: TRL's vision collator tokenizes whole conversations at each step and masks through
`{% generation %}` templates only; this keeps dstrain's one tokenized cache, its masks without a template change, and
its exact-resume data order.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ...errors import UserError
from ...vision import PER_IMAGE, PER_TOKEN, REFUSED, processor_of
from .sft import IGNORE_INDEX, Conversation, _pad_id, assistant_spans


def open_images(value, base: Path | None, where: str) -> list:
    """A row's images as RGB PIL images: file paths (relative to `base`, the dataset's folder, or absolute) or
    datasets' Image feature (decoded, or {"bytes", "path"}). A missing or unreadable image is one line."""
    import io

    from PIL import Image, UnidentifiedImageError

    if value is None:
        return []
    items = value if isinstance(value, (list, tuple)) else [value]
    out = []
    for n, item in enumerate(items):
        try:
            if isinstance(item, Image.Image):
                image = item
            elif isinstance(item, dict) and item.get("bytes"):
                image = Image.open(io.BytesIO(item["bytes"]))
            elif isinstance(item, (str, dict)):
                name = item if isinstance(item, str) else item.get("path")
                path = Path(name)
                if not path.is_absolute() and base is not None:
                    path = base / path
                if not path.is_file():
                    raise UserError(f"{where}: image {n + 1} ({name}) is not a file (relative paths are read from "
                                    f"{base}); fix the path or the row")
                image = Image.open(path)
            else:
                raise UserError(f"{where}: image {n + 1} is a {type(item).__name__}, not a path or an image")
            out.append(image.convert("RGB"))
        except (UnidentifiedImageError, OSError) as error:
            raise UserError(f"{where}: image {n + 1} cannot be read ({str(error).splitlines()[0]}); fix or remove "
                            f"it") from None
    return out


def tokens(messages: list[dict], images: list, tokenizer, processor, tools=None, prompt_turns: int = 0
           ) -> tuple[list[int], list[int], dict[str, Any]]:
    """A conversation's ids, labels (IGNORE_INDEX but on what the assistant writes) and the processor's image
    inputs: per-image arrays, and per-token ones as lists of the row's length."""
    import numpy as np

    placeholder = processor.image_token
    text, spans = assistant_spans(messages, tokenizer, tools)
    if text.count(placeholder) != len(images):
        raise ValueError(f"the conversation renders {text.count(placeholder)} image placeholders "
                         f"({placeholder}) for its {len(images)} images")
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    spans = [piece for turn, pieces in zip(turns, spans) if turn >= prompt_turns for piece in pieces]
    ids, labels, per_token, per_image, at, used = [], [], {}, {}, 0, 0
    for start, end in [*spans, (len(text), len(text))]:
        for piece, train in ((text[at:start], False), (text[start:end], True)):
            if not piece:
                continue
            count = piece.count(placeholder)
            if count and train:
                raise ValueError("an image placeholder lies in what the assistant writes")
            if count:
                out = processor(text=[piece], images=images[used:used + count], add_special_tokens=False,
                                return_tensors="np")
                used += count
                piece_ids = [int(i) for i in out["input_ids"][0]]
                for key, value in out.items():
                    if key in PER_TOKEN:
                        per_token.setdefault(key, [0] * len(ids))
                        per_token[key] += [int(v) for v in value[0]]
                    elif key in PER_IMAGE:
                        per_image.setdefault(key, []).append(images_first(key, np.asarray(value)))
            else:
                piece_ids = tokenizer(piece, add_special_tokens=False)["input_ids"]
            ids += piece_ids
            labels += piece_ids if train else [IGNORE_INDEX] * len(piece_ids)
            for key in per_token:
                per_token[key] += [0] * (len(ids) - len(per_token[key]))
        at = end
    extras = {key: np.concatenate(parts) for key, parts in per_image.items()}
    return ids, labels, extras | per_token


def images_first(key: str, value):
    """A per-image input with the images on its first axis: Idefics3's and SmolVLM's processors give pixels as
    (rows, images, C, H, W) and their mask as (rows, images, H, W), padded with blank images to the row with the
    most; a row's are kept image by image (the others' already are), so rows with different numbers of images
    concatenate (with_fake_image gives the model its axes back)."""
    if value.ndim == {"pixel_values": 5, "pixel_attention_mask": 4}.get(key):
        return value.reshape(-1, *value.shape[2:])
    return value


def image_token_ids(processor) -> set[int]:
    """The ids the processor writes for images (what a truncation must not cut)."""
    tok = processor.tokenizer
    found = {tok.convert_tokens_to_ids(processor.image_token)}
    for name in ("image_token", "boi_token", "eoi_token", "image_start_token", "image_end_token"):
        value = getattr(processor, name, None) or getattr(tok, name, None)
        if isinstance(value, str):
            found.add(tok.convert_tokens_to_ids(value))
    if getattr(processor, "image_token_id", None) is not None:
        found.add(processor.image_token_id)
    return found


LLAVA_IMAGE = "image"  # LLaVA's data layout: the row's image, `<image>` where it goes in a message's text
LLAVA_PLACEHOLDER = "<image>"


def refuse_for_text_model(dataset, cfg) -> None:
    """Images given to a text model (TRL's `images` column or LLaVA's `image`, in any data format) are one line: they
    would be dropped and the text trained alone."""
    for column in (cfg.images_field, LLAVA_IMAGE):
        if column in dataset.column_names and any(dataset[column]):
            raise UserError(f"{cfg.path} has images (its '{column}' column), and the model is a text model: they "
                            f"would be dropped and the text trained alone; train an image-text-to-text model "
                            f"(docs/vision.md), or remove the column")


def inline_images(messages: list[dict]) -> list[dict]:
    """LLaVA's layout as TRL's: each `<image>` in a message's text becomes an image part where it stands (the text
    around it kept as text parts); messages that already hold parts are left as they are."""
    if any(isinstance(m["content"], list) for m in messages):
        return messages
    out = []
    for message in messages:
        text = message["content"]
        if LLAVA_PLACEHOLDER not in text:
            out.append(message)
            continue
        parts = []
        for n, piece in enumerate(text.split(LLAVA_PLACEHOLDER)):
            if n:
                parts.append({"type": "image"})
            if piece:
                parts.append({"type": "text", "text": piece})
        out.append(dict(message, content=parts))
    result = type(messages)(out)  # a Conversation keeps where its prompt ends
    if hasattr(messages, "prompt_turns"):
        result.prompt_turns = messages.prompt_turns
    return result


def fake_image(processor, pad: int) -> dict:
    """A blank image as the processor gives it (its image tokens, per-image and per-token inputs), for
    with_fake_image."""
    from PIL import Image
    out = processor(text=[processor.image_token], images=[Image.new("RGB", (32, 32))], add_special_tokens=False,
                    return_tensors="pt")
    return {"input_ids": out["input_ids"][0], "pad": pad, **{k: out[k] for k in PER_IMAGE if k in out},
            **{k: out[k][0] for k in PER_TOKEN if k in out}}


def with_fake_image(batch: dict, fake: dict) -> dict:
    """A micro-batch without images, given a blank image the loss never sees: every rank must run the vision tower
    and projector in every micro-batch (under ZeRO-3 their forward gathers and their gradients' reductions are
    collectives; a rank whose micro-batch held no image skipped them and the job stopped: seen, exit -6). The
    image's tokens are appended after every row's end (row 0 holds them; the others padding), masked out of
    attention and of the labels: under causal attention no real token can see them, and the tower's gradient from
    them is zero. LLaMA-Factory adds such a fake image to text-only rows for the same reason; here only to a
    micro-batch that has none, at the end, so real tokens keep their positions."""
    import torch
    if "pixel_values" in batch:
        if fake["pixel_values"].dim() == batch["pixel_values"].dim() + 1:  # (rows, images, ...): all in one row
            return batch | {k: batch[k][None] for k in ("pixel_values", "pixel_attention_mask") if k in batch}
        return batch
    ids = fake["input_ids"]
    n, rows = len(ids), batch["input_ids"].shape[0]

    def widen(tensor, value):
        return torch.cat([tensor, tensor.new_full((rows, n), value)], dim=1)
    out = dict(batch, input_ids=widen(batch["input_ids"], fake["pad"]), labels=widen(batch["labels"], IGNORE_INDEX),
               attention_mask=widen(batch["attention_mask"], 0))
    out["input_ids"][0, -n:] = ids
    for key in PER_TOKEN:
        if key in fake:
            base = batch[key] if key in batch else torch.zeros_like(batch["input_ids"])
            out[key] = widen(base, 0)
            out[key][0, -n:] = fake[key]
    for key in PER_IMAGE:
        if key in fake:
            out[key] = fake[key]
    return out


def fit(ids: list[int], labels: list[int], extras: dict, seq_len: int, pad: int, image_ids: set[int],
        where: str) -> dict | None:
    """Padded to seq_len, or truncated after the last image token (a cut image is one line naming the row)."""
    if len(ids) > seq_len and any(i in image_ids for i in ids[seq_len:]):
        last = max(k for k, i in enumerate(ids) if i in image_ids)
        raise UserError(f"{where}: its images end at token {last + 1} and train.seq_len={seq_len} would cut an image; "
                        f"raise train.seq_len, use smaller images (the processor's size), or drop the row")
    ids, labels = ids[:seq_len], labels[:seq_len]
    if all(label == IGNORE_INDEX for label in labels[1:]):
        return None
    n_pad = seq_len - len(ids)
    out = {"input_ids": ids + [pad] * n_pad, "labels": labels + [IGNORE_INDEX] * n_pad,
           "attention_mask": [1] * len(ids) + [0] * n_pad}
    for key, value in extras.items():
        out[key] = value[:seq_len] + [0] * n_pad if key in PER_TOKEN else value
    return out


def batch(batch: dict) -> dict:
    """A micro-batch's per-image inputs as one tensor (the rows' images in order), as the processor gives them for
    several rows at once."""
    import torch
    for key in PER_IMAGE:
        if key in batch:
            value = batch[key]
            rows = [torch.as_tensor(r) for r in (value if isinstance(value, (list, tuple)) or value.dim() > 1
                                                 else [value])]
            rows = [r for r in rows if r.numel()]  # a row without images holds an empty list
            if not rows:
                del batch[key]
                continue
            batch[key] = torch.cat(rows).float() if key == "pixel_values" else torch.cat(rows)
    return batch


def check_template(tokenizer, processor) -> None:
    """The run's chat template renders an image part as the processor's placeholder, or one line."""
    probe = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
             {"role": "assistant", "content": "A square."}]
    try:
        text = tokenizer.apply_chat_template(probe, tokenize=False)
    except Exception as error:  # noqa: BLE001 - a template that cannot render image parts
        text = f"{type(error).__name__}: {error}"
    if text.count(processor.image_token) != 1:
        raise UserError(f"the chat template does not render an image part as the processor's image token "
                        f"({processor.image_token}): the model would never see the images; use the model's own "
                        f"template (data.chat_template: null)")


def _images_base(cfg) -> Path | None:
    from ...paths import local_or_hub
    path = Path(local_or_hub(cfg.path))
    return path.parent if path.is_file() else path if path.is_dir() else None


def tokenize(dataset, cfg, tokenizer, seq_len: int, num_proc: int | None, to_messages, to_tools
             ) -> tuple[Any, dict]:
    """A chat split for a vision-language model: input_ids / labels / attention_mask padded to seq_len, and the
    processor's image inputs per row. Counts as sft.tokenize's (truncated, dropped, trained tokens)."""
    import numpy as np

    processor = processor_of(tokenizer)
    check_template(tokenizer, processor)
    if cfg.packing:
        raise UserError(f"data.packing with a vision-language model: {REFUSED['packing'][1]}")
    if not cfg.assistant_only_loss:
        raise UserError("data.assistant_only_loss=false with a vision-language model: the loss would fall on image "
                        "tokens; keep it true")
    base, pad, image_ids = _images_base(cfg), _pad_id(tokenizer), image_token_ids(processor)
    # what the processor gives for an image, per image and per token: every row holds them (empty or zeros without)
    probe = fake_image(processor, pad)
    keys = [key for key in probe if key in PER_IMAGE or key in PER_TOKEN]
    # a row without images holds empty arrays of the per-image shape: the rows' arrays go to arrow as numpy, not as
    # Python lists (.tolist() of every row's pixels was rank 0's peak while building the cache: bench/vlm.py's
    # tiny job 690 MiB against 584), and arrow takes a batch of them only if every row's has the same rank
    empty = {key: np.zeros((0, *images_first(key, probe[key].numpy()).shape[1:]), dtype=probe[key].numpy().dtype)
             for key in keys if key in PER_IMAGE}
    # TRL's `images` (data.images_field), or LLaVA's layout: one `image` per row, `<image>` in the conversation's text
    column = cfg.images_field if cfg.images_field in dataset.column_names else \
        LLAVA_IMAGE if LLAVA_IMAGE in dataset.column_names else None
    has_images = column is not None

    def fn(row, index):
        where = f"{cfg.path} row {index + 1}"
        messages = to_messages(row, cfg)
        images = open_images(row.get(column), base, where) if has_images else []
        if column == LLAVA_IMAGE:
            messages = inline_images(messages)
        placeholders = sum(p.get("type") == "image" for m in messages if isinstance(m["content"], list)
                           for p in m["content"])
        if placeholders != len(images):
            raise UserError(f"{where}: its messages hold {placeholders} image parts and its '{cfg.images_field}' "
                            f"{len(images)} images; each {{\"type\": \"image\"}} part takes the next image")
        prompt_turns = getattr(messages, "prompt_turns", 0) if isinstance(messages, Conversation) else 0
        if cfg.last_turn_only:
            prompt_turns = max([prompt_turns] + [i for i, m in enumerate(messages) if m["role"] == "assistant"])
        ids, labels, extras = tokens(messages, images, tokenizer, processor, to_tools(row, cfg), prompt_turns)
        extras = {key: extras.get(key, [0] * len(ids) if key in PER_TOKEN else empty[key]) for key in keys}
        example = fit(ids, labels, extras, seq_len, pad, image_ids, where)
        if example is None:
            return {"input_ids": [], "labels": [], "attention_mask": [], **{key: empty.get(key, []) for key in keys},
                    "full_length": -len(ids), "has_reply": any(label != IGNORE_INDEX for label in labels),
                    "image_count": 0}
        return example | {"full_length": len(ids), "has_reply": True, "image_count": len(images)}

    marked = dataset.map(fn, with_indices=True, remove_columns=dataset.column_names, num_proc=num_proc,
                         desc="tokenizing (images through the processor)")
    lengths = np.asarray(marked["full_length"], dtype=np.int64)
    kept = np.flatnonzero(lengths >= 0)
    out = marked.select(kept).remove_columns(["full_length", "has_reply", "image_count"])
    stats = {"examples": len(dataset), "sequences": len(out), "truncated": int((lengths > seq_len).sum()),
             "dropped": int((lengths < 0).sum()), "no_reply": int(len(dataset) - sum(marked["has_reply"]))}
    if len(out):
        stats["tokens"] = int(sum(sum(mask) for mask in out["attention_mask"]))
        stats["trained_tokens"] = int(sum(sum(label != IGNORE_INDEX for label in labels) for labels in out["labels"]))
        stats["padding"] = 1 - int(np.minimum(lengths[kept], seq_len).sum()) / (len(out) * seq_len)
        stats["images"] = int(np.asarray(marked["image_count"], dtype=np.int64)[kept].sum())  # not crops or patches
    return out, stats
