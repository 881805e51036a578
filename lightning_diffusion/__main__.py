from lightning_diffusion.cli import main

main()
