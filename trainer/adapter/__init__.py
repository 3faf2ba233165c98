"""LoRA adapter pushes: send a PEFT model's adapter, not the merged model."""
