package admin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/net/netutil"
	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/fsutil"
)

// Endpoints are where a Server listens. Projection never depends on them:
// an endpoint that cannot listen is reported and retried in the
// background.
type Endpoints struct {
	// Address is the public endpoint, for Prometheus and health checks:
	// "host:port" on loopback, or "unix:/path" (a socket of mode 0660);
	// "" for none. It serves /metrics, /healthz and /readyz — whose body
	// names mounts and states, never an error's text.
	Address string
	// Socket is the path of the private endpoint: a unix socket of mode
	// 0600 in a directory that only root can write (created, 0755, when
	// missing). It serves every route, /status included, which kvmount
	// status reads after checking that the socket's owner is root. ""
	// for none.
	Socket string
}

// Limits of every endpoint: a client that opens connections and sends
// nothing can hold at most MaxConnections of kvmount's file descriptors,
// each for at most IdleTimeout — never the daemon's all.
const (
	// MaxConnections is how many connections one endpoint serves at
	// once; more wait in the kernel's backlog, costing kvmount nothing.
	MaxConnections = 32
	// ReadTimeout bounds reading a request, headers and body.
	ReadTimeout = 5 * time.Second
	// WriteTimeout bounds writing a response.
	WriteTimeout = 10 * time.Second
	// IdleTimeout closes a kept-alive connection without a request.
	IdleTimeout = 30 * time.Second
	// RetryMax is the longest wait between two attempts to listen.
	RetryMax = 30 * time.Second
)

// EndpointStatus is an endpoint's state in /status.
type EndpointStatus struct {
	Address   string `json:"address"`
	Private   bool   `json:"private"`
	Listening bool   `json:"listening"`
	// Error is why it does not listen; it is retried meanwhile.
	Error string `json:"error,omitempty"`
}

// endpoint is one listening address and its goroutine.
type endpoint struct {
	address string
	private bool
	cancel  context.CancelFunc
	done    chan struct{}
}

// SetEndpoints makes e the endpoints the server listens on: an endpoint
// no longer wanted stops (its requests in progress get 5 s), a new one
// starts listening in the background, an unchanged one is left alone. It
// returns at once; Status reports each endpoint's state.
func (s *Server) SetEndpoints(e Endpoints) {
	s.epMu.Lock()
	defer s.epMu.Unlock()
	want := map[string]bool{}
	if e.Address != "" {
		want[e.Address] = false
	}
	if e.Socket != "" {
		want["unix:"+e.Socket] = true
	}
	for key, ep := range s.endpoints {
		if private, ok := want[ep.address]; !ok || private != ep.private {
			ep.cancel()
			<-ep.done
			delete(s.endpoints, key)
			s.setEndpointState(ep.address, ep.private, nil, false)
		}
	}
	for address, private := range want {
		if s.endpoints[address] != nil || s.stopped {
			continue
		}
		ctx, cancel := context.WithCancel(context.Background())
		ep := &endpoint{address: address, private: private, cancel: cancel, done: make(chan struct{})}
		s.endpoints[address] = ep
		go func() {
			defer close(ep.done)
			s.serveEndpoint(ctx, ep)
		}()
	}
}

// Run returns once ctx is done, after stopping every endpoint.
func (s *Server) Run(ctx context.Context) error {
	<-ctx.Done()
	s.epMu.Lock()
	defer s.epMu.Unlock()
	s.stopped = true
	for key, ep := range s.endpoints {
		ep.cancel()
		<-ep.done
		delete(s.endpoints, key)
	}
	return nil
}

// serveEndpoint listens on ep, retrying with backoff (1 s doubling to
// RetryMax) while it cannot — a port taken by someone else is reported,
// never fatal — and serves it until ctx is done.
func (s *Server) serveEndpoint(ctx context.Context, ep *endpoint) {
	wait := time.Second
	for {
		l, err := listen(ep.address, ep.private)
		if err != nil {
			s.setEndpointState(ep.address, ep.private, err, false)
			s.opts.Log.Warn("admin endpoint cannot listen; retrying", "address", ep.address, "retry_in", wait, "err", err)
			t := time.NewTimer(wait)
			select {
			case <-ctx.Done():
				t.Stop()
				return
			case <-t.C:
			}
			wait = min(2*wait, RetryMax)
			continue
		}
		wait = time.Second
		s.setEndpointState(ep.address, ep.private, nil, true)
		s.opts.Log.Info("admin endpoint listening", "address", ep.address, "private", ep.private)
		srv := &http.Server{
			Handler:           s.handler(ep.private),
			ReadHeaderTimeout: ReadTimeout,
			ReadTimeout:       ReadTimeout,
			WriteTimeout:      WriteTimeout,
			IdleTimeout:       IdleTimeout,
			MaxHeaderBytes:    8 << 10,
			ErrorLog:          log.New(io.Discard, "", 0),
		}
		done := make(chan error, 1)
		go func() { done <- srv.Serve(netutil.LimitListener(limitPerUser(l), MaxConnections)) }()
		select {
		case err = <-done:
		case <-ctx.Done():
			sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			_ = srv.Shutdown(sctx)
			cancel()
			<-done
			return
		}
		s.setEndpointState(ep.address, ep.private, err, false)
		s.opts.Log.Warn("admin endpoint stopped serving; listening again", "address", ep.address, "err", err)
	}
}

// setEndpointState records an endpoint's state for /status.
func (s *Server) setEndpointState(address string, private bool, err error, listening bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := &EndpointStatus{Address: address, Private: private, Listening: listening}
	if err != nil {
		st.Error = err.Error()
	}
	s.endpointState[address] = st
}

// adoptTimeout bounds how long POST /adopt waits for the reconciler's loop.
const adoptTimeout = 10 * time.Second

// handler returns the routes of a public or private endpoint.
func (s *Server) handler(private bool) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(s.reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), pingTimeout)
		defer cancel()
		if s.opts.Ping != nil {
			if err := s.opts.Ping(ctx); err != nil {
				http.Error(w, "reconciler loop not answering: "+err.Error(), http.StatusServiceUnavailable)
				return
			}
		}
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		st := s.Status()
		if !st.Ready {
			w.WriteHeader(http.StatusServiceUnavailable)
			reasons := st.Reasons
			if !private {
				reasons = st.brief
			}
			fmt.Fprintln(w, strings.Join(reasons, "\n"))
			return
		}
		fmt.Fprintln(w, "ready")
	})
	if private {
		mux.HandleFunc("GET /status", func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			enc := json.NewEncoder(w)
			enc.SetIndent("", "  ")
			_ = enc.Encode(s.Status())
		})
		if s.opts.Adopt != nil {
			mux.HandleFunc("POST /adopt", func(w http.ResponseWriter, r *http.Request) {
				mount := r.URL.Query().Get("mount")
				if mount == "" {
					http.Error(w, "adopt: the mount query parameter is missing", http.StatusBadRequest)
					return
				}
				ctx, cancel := context.WithTimeout(r.Context(), adoptTimeout)
				defer cancel()
				if err := s.opts.Adopt(ctx, mount); err != nil {
					http.Error(w, err.Error(), http.StatusConflict)
					return
				}
				fmt.Fprintf(w, "mount %q: its directory is taken over at once\n", mount)
			})
		}
	}
	return mux
}

// Handler returns the private endpoint's routes — every route — for tests
// and embedding.
func (s *Server) Handler() http.Handler { return s.handler(true) }

// listen opens address: "host:port" (TCP) or "unix:/path". A unix socket
// is made in its directory — the private one created if missing, and
// refused unless only root (kvmount's user) can write it — through the
// directory's handle, so that no symlink is followed, with the process
// umask set so that the socket is born with its mode (0600 private, 0660
// else): it is never chmod'ed by path afterwards. A stale socket left
// there is replaced; a live one, or anything else there, is an error.
func listen(address string, private bool) (net.Listener, error) {
	path, ok := strings.CutPrefix(address, "unix:")
	if !ok {
		return net.Listen("tcp", address)
	}
	dirPath, name := filepath.Split(path)
	var dir *os.File
	var err error
	if private {
		dir, _, err = fsutil.MakeDir(dirPath, 0o755, -1, -1)
	} else {
		dir, err = fsutil.OpenDir(filepath.Clean(dirPath))
	}
	if err != nil {
		return nil, err
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(dir.Fd()), &st); err != nil {
		dir.Close()
		return nil, err
	}
	if private && (int(st.Uid) != os.Geteuid() || st.Mode&0o022 != 0) {
		dir.Close()
		return nil, fmt.Errorf("%s: the directory of a private socket must be writable by kvmount's user alone (it is uid %d's, mode %04o)", dirPath, st.Uid, st.Mode&0o7777)
	}
	switch err := unix.Fstatat(int(dir.Fd()), name, &st, unix.AT_SYMLINK_NOFOLLOW); {
	case errors.Is(err, unix.ENOENT):
	case err != nil:
		dir.Close()
		return nil, &fs.PathError{Op: "stat", Path: path, Err: err}
	case st.Mode&unix.S_IFMT != unix.S_IFSOCK:
		dir.Close()
		return nil, fmt.Errorf("%s exists and is not a socket", path)
	default:
		if c, err := net.DialTimeout("unix", fsutil.ProcPath(dir)+"/"+name, time.Second); err == nil {
			c.Close()
			dir.Close()
			return nil, fmt.Errorf("%s: another process listens on it", path)
		}
		if err := unix.Unlinkat(int(dir.Fd()), name, 0); err != nil {
			dir.Close()
			return nil, &fs.PathError{Op: "remove stale socket", Path: path, Err: err}
		}
	}
	mode := 0o660
	if private {
		mode = 0o600
	}
	umaskMu.Lock()
	old := syscall.Umask(0o777 &^ mode)
	l, err := net.Listen("unix", fsutil.ProcPath(dir)+"/"+name)
	syscall.Umask(old)
	umaskMu.Unlock()
	if err != nil {
		dir.Close()
		return nil, fmt.Errorf("listen %s: %w", path, errors.Unwrap(err))
	}
	ul := l.(*net.UnixListener)
	ul.SetUnlinkOnClose(false)
	return &unixListener{UnixListener: ul, dir: dir, name: name}, nil
}

// umaskMu serialises the listens that set the umask.
var umaskMu sync.Mutex

// unixListener removes its socket, through its directory's handle, when
// closed.
type unixListener struct {
	*net.UnixListener
	dir  *os.File
	name string
	once sync.Once
}

func (l *unixListener) Close() error {
	err := l.UnixListener.Close()
	l.once.Do(func() {
		_ = unix.Unlinkat(int(l.dir.Fd()), l.name, 0)
		l.dir.Close()
	})
	return err
}
