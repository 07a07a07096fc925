from tpu_cli.main import main

main()
