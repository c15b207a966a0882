"""TEST DOUBLES of a prefill and a decode worker, for `kvferry bench gateway` and the tests: no model, no torch.

They speak the real protocol (common/protocol.py, through the real Channel and GatewayLink), register like real
workers and answer as they would (a FirstToken per choice, the KV handoff as a KVTransfer of no blocks, Tokens every
step), so that the real gateway can be measured alone. They register under their own model name,
SYNTHETIC_MODEL_NAME: a gateway serving a real model refuses them, so they never serve production traffic.
"""
