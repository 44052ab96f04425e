// Command kubelet is the upstream Kubernetes node agent (k8s.io/kubernetes v1.37.2), built as a
// sysdra test peer: the real node (tests/realnode.py) runs it against containerd, and it is the
// DRA plugin's real customer (registration, NodePrepareResources, slice wiping, health).
package main

import (
	"context"
	"os"

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	"k8s.io/kubernetes/cmd/kubelet/app"
)

func main() {
	os.Exit(cli.Run(app.NewKubeletCommand(context.Background())))
}
