"""The paged KV cache's bookkeeping and the packed forward that plans rows into it: which slot
holds which token or tree node per request (slot_table.py), and one forward over many requests'
rows (packed_forward.py). Shared by every pipeline stage (worker/) and the draft model
(spec_decode/draft_model.py), which plan and pack the same way."""
