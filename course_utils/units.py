"""Binary byte units, as GPU tools (nvidia-smi, torch.cuda.memory_summary) report memory."""
KIB = 1024
MIB = 1024**2
GIB = 1024**3
