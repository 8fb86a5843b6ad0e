// Command registry serves an OCI image registry for the local control plane: `make
// docker-push` pushes to it and the real node's containerd pulls from it, as a cluster pulls
// from a registry. Blobs are kept on disk under -blobs; manifests and tags in memory, so a
// restarted registry is empty.
package main

import (
	"flag"
	"log"
	"net"
	"net/http"
	"os"
	"time"

	"github.com/google/go-containerregistry/pkg/registry"
)

func main() {
	address := flag.String("address", "127.0.0.1:5000", "address to listen on")
	blobs := flag.String("blobs", "", "directory for blobs (in memory when empty)")
	flag.Parse()

	logger := log.New(os.Stderr, "registry ", log.LstdFlags)
	opts := []registry.Option{registry.Logger(logger)}
	if *blobs != "" {
		if err := os.MkdirAll(*blobs, 0o755); err != nil {
			logger.Fatal(err)
		}
		opts = append(opts, registry.WithBlobHandler(registry.NewDiskBlobHandler(*blobs)))
	}
	listener, err := net.Listen("tcp", *address)
	if err != nil {
		logger.Fatal(err)
	}
	logger.Printf("serving on %s", listener.Addr())
	server := &http.Server{ReadHeaderTimeout: 10 * time.Second, Handler: registry.New(opts...)}
	logger.Fatal(server.Serve(listener))
}
