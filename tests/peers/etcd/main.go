// Command etcd is upstream etcd (go.etcd.io/etcd/server/v3, the version k8s.io/kubernetes
// v1.37.2 requires), built as a sysdra test peer: the upstream etcdmain, flags and all.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
