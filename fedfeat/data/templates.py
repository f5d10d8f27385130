"""Prompt templates for the class-name text embeddings.

A template is a Python format string with one ``{}`` slot for the class name. ``encode`` stores one text
embedding per template x class (``text/features  # [T, K, D]``), so methods can use a single prompt or
average an ensemble.

Named sets (``--templates NAME``):

- ``single``: ``a photo of a {}.`` (the default; FST-CBDG / CLIP2FL / FedCoPL use this prompt, with or
  without the full stop).
- ``cifar``: CLIP_benchmark's 18 templates for CIFAR-10/100
  (``clip_benchmark/datasets/en_zeroshot_classification_templates.json``).
- ``imagenet``: CLIP's 80 ImageNet templates (``open_clip.zero_shot_metadata.OPENAI_IMAGENET_TEMPLATES``).

Anything else is read as a text file with one template per line (``{}`` or ``{c}`` as the slot; blank lines
and lines starting with ``#`` are ignored), or, if it contains ``{}`` and is not a file, used as one template.

Example::

    >>> resolve_templates("single")
    ['a photo of a {}.']
    >>> len(resolve_templates("cifar")), len(resolve_templates("imagenet"))
    (18, 80)
    >>> fill("a photo of a {}.", "aquarium fish")
    'a photo of a aquarium fish.'
"""

from __future__ import annotations

from pathlib import Path

from fedfeat.errors import FedfeatError

DEFAULT_TEMPLATE = "a photo of a {}."

# CLIP_benchmark, en_zeroshot_classification_templates.json, keys "cifar10" and "cifar100" (identical lists).
CIFAR_TEMPLATES: tuple[str, ...] = (
    "a photo of a {}.",
    "a blurry photo of a {}.",
    "a black and white photo of a {}.",
    "a low contrast photo of a {}.",
    "a high contrast photo of a {}.",
    "a bad photo of a {}.",
    "a good photo of a {}.",
    "a photo of a small {}.",
    "a photo of a big {}.",
    "a photo of the {}.",
    "a blurry photo of the {}.",
    "a black and white photo of the {}.",
    "a low contrast photo of the {}.",
    "a high contrast photo of the {}.",
    "a bad photo of the {}.",
    "a good photo of the {}.",
    "a photo of the small {}.",
    "a photo of the big {}.",
)

# CLIP's 80 ImageNet templates, in the order of open_clip's OPENAI_IMAGENET_TEMPLATES (a test checks it).
IMAGENET_TEMPLATES: tuple[str, ...] = (
    "a bad photo of a {}.",
    "a photo of many {}.",
    "a sculpture of a {}.",
    "a photo of the hard to see {}.",
    "a low resolution photo of the {}.",
    "a rendering of a {}.",
    "graffiti of a {}.",
    "a bad photo of the {}.",
    "a cropped photo of the {}.",
    "a tattoo of a {}.",
    "the embroidered {}.",
    "a photo of a hard to see {}.",
    "a bright photo of a {}.",
    "a photo of a clean {}.",
    "a photo of a dirty {}.",
    "a dark photo of the {}.",
    "a drawing of a {}.",
    "a photo of my {}.",
    "the plastic {}.",
    "a photo of the cool {}.",
    "a close-up photo of a {}.",
    "a black and white photo of the {}.",
    "a painting of the {}.",
    "a painting of a {}.",
    "a pixelated photo of the {}.",
    "a sculpture of the {}.",
    "a bright photo of the {}.",
    "a cropped photo of a {}.",
    "a plastic {}.",
    "a photo of the dirty {}.",
    "a jpeg corrupted photo of a {}.",
    "a blurry photo of the {}.",
    "a photo of the {}.",
    "a good photo of the {}.",
    "a rendering of the {}.",
    "a {} in a video game.",
    "a photo of one {}.",
    "a doodle of a {}.",
    "a close-up photo of the {}.",
    "a photo of a {}.",
    "the origami {}.",
    "the {} in a video game.",
    "a sketch of a {}.",
    "a doodle of the {}.",
    "a origami {}.",
    "a low resolution photo of a {}.",
    "the toy {}.",
    "a rendition of the {}.",
    "a photo of the clean {}.",
    "a photo of a large {}.",
    "a rendition of a {}.",
    "a photo of a nice {}.",
    "a photo of a weird {}.",
    "a blurry photo of a {}.",
    "a cartoon {}.",
    "art of a {}.",
    "a sketch of the {}.",
    "a embroidered {}.",
    "a pixelated photo of a {}.",
    "itap of the {}.",
    "a jpeg corrupted photo of the {}.",
    "a good photo of a {}.",
    "a plushie {}.",
    "a photo of the nice {}.",
    "a photo of the small {}.",
    "a photo of the weird {}.",
    "the cartoon {}.",
    "art of the {}.",
    "a drawing of the {}.",
    "a photo of the large {}.",
    "a black and white photo of a {}.",
    "the plushie {}.",
    "a dark photo of a {}.",
    "itap of a {}.",
    "graffiti of the {}.",
    "a toy {}.",
    "itap of my {}.",
    "a photo of a cool {}.",
    "a photo of a small {}.",
    "a tattoo of the {}.",
)

TEMPLATE_SETS: dict[str, tuple[str, ...]] = {
    "single": (DEFAULT_TEMPLATE,),
    "cifar": CIFAR_TEMPLATES,
    "imagenet": IMAGENET_TEMPLATES,
}


def _check(template: str, where: str) -> str:
    t = template.replace("{c}", "{}")
    if t.count("{}") != 1 or t.replace("{}", "").count("{") or t.replace("{}", "").count("}"):
        raise FedfeatError(
            f"template {template!r} ({where}) must contain exactly one '{{}}' slot for the class name "
            "and no other braces, e.g. 'a photo of a {}.'"
        )
    return t


def resolve_templates(spec: str | None = None) -> list[str]:
    """The templates named by ``spec``: a set name (``single``, ``cifar``, ``imagenet``), a file with one
    template per line, or a single template containing ``{}``. ``None`` means ``single``.

    Example::

        >>> resolve_templates("a sketch of a {}.")
        ['a sketch of a {}.']
    """
    spec = "single" if spec is None else spec
    if spec in TEMPLATE_SETS:
        return list(TEMPLATE_SETS[spec])
    path = Path(spec).expanduser()
    if path.is_file():
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise FedfeatError(f"cannot read template file {path}: {e}; give a UTF-8 text file") from None
        out = [
            _check(line.strip(), f"{path}:{i + 1}")
            for i, line in enumerate(lines)
            if line.strip() and not line.lstrip().startswith("#")
        ]
        if not out:
            raise FedfeatError(
                f"template file {path} has no templates; write one per line, e.g. 'a photo of a {{}}.'"
            )
        if len(set(out)) != len(out):
            raise FedfeatError(f"template file {path} lists a template twice; remove the duplicate")
        return out
    if "{" in spec:
        return [_check(spec, "--templates")]
    raise FedfeatError(
        f"unknown templates '{spec}': not a set name ({', '.join(TEMPLATE_SETS)}), not a file, "
        "and no '{}' slot; pass e.g. --templates cifar or --templates 'a photo of a {}.'"
    )


def fill(template: str, class_name: str) -> str:
    """The prompt for one class: ``template`` with its ``{}`` slot filled."""
    return template.replace("{}", class_name)
