"""``torch.save`` files without trusting them: the restricted unpickler, safe loads, zip records, byte ranges.

Nothing here knows Megatron or DCP; the formats read every ``.pt`` file and
every DCP item through these modules.
"""
