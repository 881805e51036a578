from lightning_diffusion.cli import run

run()
