package daemon

import (
	"context"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvmount/kvmount/internal/etcdtest"
)

// TestTemplates end to end against etcd: a template over the prefix
// re-renders when a key is added, changed or deleted; a missing key keeps
// the last content and is named in the log; an edited template file is
// read on SIGHUP; Render prints what run writes, byte for byte.
func TestTemplates(t *testing.T) {
	h := newHarness(t)
	tmplFile := h.path("all.tmpl")
	write := func(text string) {
		if err := os.WriteFile(tmplFile, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write(`{{ key "must" }}:{{ range tree "kv" }}{{ .Key }}={{ .Value }};{{ end }}`)
	h.put("/t/must", "M", "/t/kv/a", "1", "/t/kv/b", "2")
	h.writeConfig(h.mount("t", "/t/", fmt.Sprintf("  [[mount.templates]]\n  path = \"out/all.conf\"\n  file = %q\n  mode = \"0600\"\n", tmplFile)))
	h.start()
	dir := h.path("mnt", "t")
	base := map[string]string{"must": "M"}
	want := func(render string, kv ...string) map[string]string {
		m := maps.Clone(base)
		for i := 0; i+1 < len(kv); i += 2 {
			m["kv/"+kv[i]] = kv[i+1]
		}
		m["out/all.conf"] = render
		return m
	}
	h.waitContent(dir, want("M:a=1;b=2;", "a", "1", "b", "2"))
	if info, err := os.Stat(filepath.Join(dir, "out/all.conf")); err != nil || info.Mode().Perm() != 0o600 {
		t.Errorf("rendered file mode: %v, %v; want 0600", info, err)
	}
	h.put("/t/kv/c", "3")
	h.waitContent(dir, want("M:a=1;b=2;c=3;", "a", "1", "b", "2", "c", "3"))
	h.put("/t/kv/a", "one")
	h.waitContent(dir, want("M:a=one;b=2;c=3;", "a", "one", "b", "2", "c", "3"))
	h.put("/t/kv/b", etcdtest.Delete)
	last := want("M:a=one;c=3;", "a", "one", "c", "3")
	h.waitContent(dir, last)

	// Render prints what run wrote, byte for byte: through a worker, and
	// in its own process.
	for _, inProcess := range []bool{false, true} {
		opts := h.options()
		opts.InProcess = inProcess
		payload, err := Render(context.Background(), opts, "t", waitTimeout)
		if err != nil {
			t.Fatal(err)
		}
		got, _ := content(dir)
		if len(payload) != len(got) {
			t.Errorf("Render (in process: %v) gave %d files; the mount holds %d", inProcess, len(payload), len(got))
		}
		for p, f := range payload {
			if got[p] != string(f.Data) {
				t.Errorf("Render (in process: %v) %s = %q; the mount holds %q", inProcess, p, f.Data, got[p])
			}
		}
	}

	// A missing key keeps the last content and is named.
	h.put("/t/must", etcdtest.Delete)
	h.waitLog("cannot build mount payload", "mount=t", `key \"must\" does not exist`)
	if got, _ := content(dir); got["out/all.conf"] != "M:a=one;c=3;" {
		t.Errorf("after a missing key the mount holds %v", got)
	}
	if _, err := Render(context.Background(), h.options(), "t", waitTimeout); err == nil {
		t.Errorf("Render with a missing key succeeded")
	}
	h.put("/t/must", "N")
	base["must"] = "N"
	h.waitContent(dir, want("N:a=one;c=3;", "a", "one", "c", "3"))

	// An edited template file is read on SIGHUP.
	write(`v2 {{ len (tree "kv") }}`)
	h.sighup()
	h.waitContent(dir, want("v2 2", "a", "one", "c", "3"))
}

// TestTemplateSwitchesWithItsKeys: a reader that resolves ..data once
// never sees a rendered file of another revision than the key files beside
// it, while multi-key transactions stream in.
func TestTemplateSwitchesWithItsKeys(t *testing.T) {
	h := newHarness(t)
	txn := func(n int) { h.put("/ts/a", record(n), "/ts/b", record(n)) }
	txn(0)
	h.writeConfig(h.mount("ts", "/ts/", "  [[mount.templates]]\n  path = \"both.conf\"\n  text = '{{ key \"a\" }}|{{ key \"b\" }}'\n"))
	h.start()
	dir := h.path("mnt", "ts")
	h.waitContent(dir, map[string]string{"a": record(0), "b": record(0), "both.conf": record(0) + "|" + record(0)})
	stop := readVersions(t, dir, []string{"a", "b", "both.conf"}, func(version string, v []string) {
		if v[2] != v[0]+"|"+v[1] || recordRev(v[0]) != recordRev(v[1]) {
			t.Errorf("version %s: a rev %d, b rev %d, both.conf %.40q", version, recordRev(v[0]), recordRev(v[1]), v[2])
		}
	})
	const rounds = 200
	for n := 1; n <= rounds; n++ {
		txn(n)
	}
	h.waitContent(dir, map[string]string{"a": record(rounds), "b": record(rounds), "both.conf": record(rounds) + "|" + record(rounds)})
	if reads := stop(); reads < 50 {
		t.Errorf("only %d whole-version reads", reads)
	}
}
