"""The forms `sdbench profile` writes: one registry, each entry a renderer (reporting/profile.py) and whether it
takes the profile of exactly one configuration (an engine's configuration holds one) or the list of them."""

from __future__ import annotations

from sdbench.registry import Registry

profile_formats: Registry = Registry("profile format")
profile_formats.add("json", "sdbench.reporting.profile:as_json",
                    "every configuration: counts, conditional and marginal rates by position, both means, intervals",
                    one=False)
profile_formats.add("vllm", "sdbench.reporting.profile:as_vllm",
                    "vLLM's --speculative-config keys for synthetic rejection sampling at the marginal rates", one=True)
profile_formats.add("llama.cpp", "sdbench.reporting.profile:as_llamacpp",
                    "llama-server's --spec-draft-n-max and --spec-synth-rates at the marginal rates", one=True)
