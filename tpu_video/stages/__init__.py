"""What the stage scripts call beyond the engine: `request` (the request flags, built from the shared and the
families' option declarations), `stage2_inputs` (stage 2's inputs read and checked per
folder, before anything loads) and `stage2_attention` (stage 2's attention plan from its flags, and where a
model that does not fit would fit)."""
