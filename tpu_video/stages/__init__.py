"""What the stage scripts call beyond the engine: `stage2_inputs` (stage 2's inputs read and checked per
folder, before anything loads)."""
