from minivllm.bench.experiments import main

raise SystemExit(main())
