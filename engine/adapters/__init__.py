"""Conversions between ``eplb.Placement`` and the live expert-location structures of engines.

``eplb_engine.adapters.sglang``: SGLang's ``ExpertLocationMetadata``;
``eplb_engine.adapters.vllm``: vLLM's ``EplbState``. Both need torch.
"""
