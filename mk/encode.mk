# Stage 1 caches: `fedfeat encode` through frozen open_clip into cache/<dataset>/<backbone>-<weights>.zarr.
# Each target is a no-op when its store is complete and its fingerprint matches (encode checks and says so);
# a killed run resumes where it stopped. Offline? pass PRETRAINED=/path/to/checkpoint (OpenAI weights from a
# file need the -quickgelu backbone, e.g. BACKBONE=RN50-quickgelu).
PY ?= .venv/bin/python
ENCODE ?= $(PY) -m fedfeat encode
ENCODE_OUT ?= cache
DATASET ?= cifar10
ROOT ?=
BACKBONE ?= RN50
PRETRAINED ?=
TEMPLATES ?= single
ENCODE_FLAGS ?=
# Where the paper targets find the data (the published archives, extracted).
DATA ?= $(HOME)/data
CIFAR10_ROOT ?= $(DATA)/cifar-10-batches-py
CIFAR100_ROOT ?= $(DATA)/cifar-100-python
CINIC10_ROOT ?= $(DATA)/cinic-10
# ImageNet-LT: the ImageNet train/val images and Liu et al.'s ImageNet_LT_train.txt / ImageNet_LT_test.txt lists
# (path label), plus a classnames.txt (one name per line, label order), as `--dataset listfile` reads them
IMAGENET_LT_ROOT ?= $(DATA)/ImageNet_LT
# The papers' own prompt ("a photo of a {}", no full stop: FST-CBDG, CLIP2FL) first, then CLIP_benchmark's 18.
PAPER_TEMPLATES ?= --templates 'a photo of a {}' --templates cifar

_pretrained = $(if $(PRETRAINED),--pretrained $(PRETRAINED))

.PHONY: cache cache-fst-cbdg cache-clip2fl cache-clip2fl-imagenet-lt

cache: install ## encode DATASET at ROOT with BACKBONE into cache/ (PRETRAINED=, TEMPLATES=, ENCODE_FLAGS=)
	@if [ -z "$(ROOT)" ]; then echo "error: set ROOT=/path/to/dataset (e.g. ROOT=~/data/cifar-10-batches-py)"; exit 2; fi
	$(ENCODE) --dataset $(DATASET) --root $(ROOT) --backbone $(BACKBONE) $(_pretrained) --templates '$(TEMPLATES)' --out $(ENCODE_OUT) $(ENCODE_FLAGS)

cache-fst-cbdg: install ## FST-CBDG caches: CIFAR-10, CIFAR-100, CINIC-10 with RN50 (roots under DATA=~/data)
	$(ENCODE) --dataset cifar10 --root $(CIFAR10_ROOT) --backbone RN50 $(_pretrained) $(PAPER_TEMPLATES) --out $(ENCODE_OUT) $(ENCODE_FLAGS)
	$(ENCODE) --dataset cifar100 --root $(CIFAR100_ROOT) --backbone RN50 $(_pretrained) $(PAPER_TEMPLATES) --out $(ENCODE_OUT) $(ENCODE_FLAGS)
	$(ENCODE) --dataset cinic10 --root $(CINIC10_ROOT) --backbone RN50 $(_pretrained) $(PAPER_TEMPLATES) --out $(ENCODE_OUT) $(ENCODE_FLAGS)

cache-clip2fl: install ## CLIP2FL caches: CIFAR-10 and CIFAR-100 with ViT-B-32 (roots under DATA=~/data)
	$(ENCODE) --dataset cifar10 --root $(CIFAR10_ROOT) --backbone ViT-B-32 $(_pretrained) $(PAPER_TEMPLATES) --out $(ENCODE_OUT) $(ENCODE_FLAGS)
	$(ENCODE) --dataset cifar100 --root $(CIFAR100_ROOT) --backbone ViT-B-32 $(_pretrained) $(PAPER_TEMPLATES) --out $(ENCODE_OUT) $(ENCODE_FLAGS)

cache-clip2fl-imagenet-lt: install ## CLIP2FL Table 2's cache: ImageNet-LT (listfile at IMAGENET_LT_ROOT) with ViT-B-32
	$(ENCODE) --dataset listfile --root $(IMAGENET_LT_ROOT) --name imagenet-lt --backbone ViT-B-32 $(_pretrained) --templates 'a photo of a {}' --out $(ENCODE_OUT) $(ENCODE_FLAGS)
