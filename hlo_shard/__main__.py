from hlo_shard.cli import main

main()
