// The whole specdec flow from Go, with grpc-go and stubs that protoc generates from protos/specdec/v1/*.proto:
//
//	GetCapabilities  ask the executor what its machine really runs, GetServerInfo its versions and limits;
//	SelectBackends   ask the selector which attention backend the target and the drafter use, and why;
//	LoadModel        load a tiny synthetic Llama target (or -target-path) and a synthetic drafter on them;
//	Generate         stream a greedy speculative generation, printing tokens as they arrive: token ids, or
//	                 with -chat a user message the server renders with the model's chat template; -stop ends
//	                 it at a stop string; then the acceptance statistics of the final message;
//	GetLoads         the executor's load.
//
// Build and run:
//
//	bash examples/go/build.sh OUT_DIR && OUT_DIR/specdec-client -selector HOST:PORT -executor HOST:PORT
//
// Addresses are gRPC targets: HOST:PORT, or dns:///NAME:PORT for replicas behind one name (a Kubernetes headless
// service), balanced with round_robin; UNAVAILABLE before any response is retried on the next replica
// (serviceConfig; grpc-go before 1.40 retries only with GRPC_GO_RETRY=on in the environment). -requests N sends
// the generation N times, spread over them. With replicas, LoadModel reaches one of them: the others must have
// loaded the same model at start (--load).
//
// Addresses default to $SPECDEC_SELECTOR and $SPECDEC_EXECUTOR; when $SPECDEC_AUTH_TOKEN is set every call
// carries `authorization: Bearer <token>`. Exits 1, printing the gRPC status, when a call fails, or naming the
// address and the cause when a server refuses the connection (at once; 10 s when nothing answers at all) or is not
// the service asked for (its gRPC health service says which specdec service answers there).
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"
	"unicode"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/resolver"
	"google.golang.org/grpc/resolver/manual"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "specdecclient/specdecv1"
)

// The target: a random-weight Llama built from a seed by the executor (no checkpoint to download).
var tinyLlama = &pb.SyntheticModel{
	Architecture:     "llama",
	VocabSize:        512,
	HiddenSize:       64,
	IntermediateSize: 128,
	NumLayers:        2,
	NumHeads:         4,
	NumKvHeads:       2,
	HeadSize:         32,
	Seed:             0,
}

// The drafter: random weights too, so its guesses rarely match the target's. With this seed the DFlash and the
// EAGLE-3 drafter each get one token of the default run accepted, so the statistics are not all zero.
const drafterSeed = 38
const blockSize = 16                  // tokens per KV-cache block
const loadTimeout = 600 * time.Second // a real checkpoint on a GPU takes a while to load and warm up
const callTimeout = 30 * time.Second
const connectTimeout = 10 * time.Second // an address that neither accepts nor refuses (a dropped SYN): given up

// services: what answers at an address, asked of its gRPC health service (open to callers without a token); the
// two specdec services register their names there.
var services = map[string]string{"executor": "specdec.v1.Executor", "selector": "specdec.v1.BackendSelector"}

// serviceConfig: client-side load balancing over every address the target resolves to, and gRPC retries of
// UNAVAILABLE for the calls that are safe to repeat. gRPC commits a call at its first response, so a Generate is
// retried only while it has produced no tokens (a replica shutting down or gone). The Python and Node.js examples
// set the same config.
const serviceConfig = `{
  "loadBalancingConfig": [{"round_robin": {}}],
  "methodConfig": [{
    "name": [
      {"service": "specdec.v1.BackendSelector"},
      {"service": "specdec.v1.Executor", "method": "Generate"},
      {"service": "specdec.v1.Executor", "method": "GetCapabilities"},
      {"service": "specdec.v1.Executor", "method": "GetModelInfo"},
      {"service": "specdec.v1.Executor", "method": "GetServerInfo"},
      {"service": "specdec.v1.Executor", "method": "GetLoads"}
    ],
    "retryPolicy": {
      "maxAttempts": 5, "initialBackoff": "0.02s", "maxBackoff": "0.2s", "backoffMultiplier": 2,
      "retryableStatusCodes": ["UNAVAILABLE"]
    }
  }]
}`

var methods = map[string]pb.SpecMethod{"dflash": pb.SpecMethod_SPEC_METHOD_DFLASH, "eagle3": pb.SpecMethod_SPEC_METHOD_EAGLE3}

type options struct {
	selector, executor, method, targetBackend, drafterBackend, prompt, targetPath, chat string
	numSpeculativeTokens, maxTokens, requests                                           int
	stop                                                                                stringList
}

// stringList is a flag that may be given several times (-stop).
type stringList []string

func (l *stringList) String() string { return strings.Join(*l, ", ") }

func (l *stringList) Set(value string) error {
	*l = append(*l, value)
	return nil
}

func envOr(name, fallback string) string {
	if value, ok := os.LookupEnv(name); ok {
		return value
	}
	return fallback
}

// draftModel is a synthetic drafter of the target's width: DFlash (2 layers, one non-causal block of k+1 positions
// filled with a mask token) or EAGLE-3 (1 layer, its own output vocabulary of half the target's).
func draftModel(method string, k int32) *pb.DraftModel {
	synthetic := proto.Clone(tinyLlama).(*pb.SyntheticModel)
	synthetic.VocabSize = 0 // 0: the target's
	synthetic.Seed = drafterSeed
	draft := &pb.DraftModel{
		Method:               methods[method],
		NumSpeculativeTokens: k,
		Source:               &pb.ModelSource{Source: &pb.ModelSource_Synthetic{Synthetic: synthetic}},
	}
	if method == "dflash" {
		synthetic.NumLayers = 2
		draft.DflashConfig = &pb.DFlashConfig{MaskTokenId: proto.Int32(tinyLlama.VocabSize - 1), BlockSize: k + 1}
	} else {
		synthetic.NumLayers = 1
		synthetic.DraftVocabSize = tinyLlama.VocabSize / 2
	}
	return draft
}

// layerSpec is what one attention stack needs, as the selector reads it.
func layerSpec(model *pb.SyntheticModel) *pb.LayerSpec {
	return &pb.LayerSpec{
		HeadSize:     model.HeadSize,
		NumHeads:     model.NumHeads,
		NumKvHeads:   model.NumKvHeads,
		Dtype:        pb.DType_DTYPE_FLOAT32,
		KvCacheDtype: "auto",
		BlockSize:    blockSize,
	}
}

func printDecision(role string, decision *pb.BackendDecision) {
	how, causality := "auto", "causal"
	if decision.Explicit {
		how = "explicit"
	}
	if decision.UseNonCausal {
		causality = "non-causal"
	}
	fmt.Printf("%s: %s (%s, %s)\n", role, decision.Backend, how, causality)
	for _, candidate := range decision.Candidates {
		verdict, selected := "ok", ""
		if len(candidate.Reasons) > 0 {
			verdict = strings.Join(candidate.Reasons, "; ")
		}
		if candidate.Backend == decision.Backend {
			selected = " <- selected"
		}
		fmt.Printf("  %s: %s%s\n", candidate.Backend, verdict, selected)
	}
}

func printStatistics(finished *pb.Finished) {
	fmt.Printf("finished: %s, %d prompt tokens, %d completion tokens\n",
		finished.FinishReason, finished.PromptTokens, finished.CompletionTokens)
	rate := 0.0
	if finished.DraftedTokens > 0 {
		rate = float64(finished.AcceptedTokens) / float64(finished.DraftedTokens)
	}
	fmt.Printf("drafted %d, accepted %d (%.1f%%), mean acceptance length %.3f\n",
		finished.DraftedTokens, finished.AcceptedTokens, 100*rate, finished.MeanAcceptanceLength)
	perPosition := make([]string, len(finished.AcceptanceRatePerPosition))
	for i, r := range finished.AcceptanceRatePerPosition {
		perPosition[i] = fmt.Sprintf("%.3f", r)
	}
	fmt.Printf("acceptance rate per position: %s\n", strings.Join(perPosition, " "))
}

func joinTokens(ids []int32) string {
	words := make([]string, len(ids))
	for i, id := range ids {
		words[i] = strconv.Itoa(int(id))
	}
	return strings.Join(words, " ")
}

func run(ctx context.Context, opts options) error {
	// WithInsecure: plaintext, as the servers serve without --tls-cert. WaitForReady: servers that are still
	// starting (docker compose up) are waited for, not failed.
	dial := []grpc.DialOption{
		grpc.WithInsecure(), grpc.WithDefaultCallOptions(grpc.WaitForReady(true)),
		grpc.WithDefaultServiceConfig(serviceConfig),
	}
	executorTarget, executorResolver := dialTarget(opts.executor)
	executorConn, err := grpc.Dial(executorTarget, append(dial, executorResolver...)...)
	if err != nil {
		return err
	}
	defer executorConn.Close()
	selectorTarget, selectorResolver := dialTarget(opts.selector)
	selectorConn, err := grpc.Dial(selectorTarget, append(dial, selectorResolver...)...)
	if err != nil {
		return err
	}
	defer selectorConn.Close()
	if err := connect(ctx, executorConn, "executor", opts.executor); err != nil {
		return err
	}
	if err := connect(ctx, selectorConn, "selector", opts.selector); err != nil {
		return err
	}
	executor, selector := pb.NewExecutorClient(executorConn), pb.NewBackendSelectorClient(selectorConn)

	callCtx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	hardware, err := executor.GetCapabilities(callCtx, &pb.GetCapabilitiesRequest{})
	if err != nil {
		return err
	}
	libraries := make([]string, len(hardware.Libraries))
	for i, lib := range hardware.Libraries {
		libraries[i] = lib.Name + " " + lib.Version
	}
	fmt.Printf("executor %s: %s %s (%s)\n", opts.executor, hardware.Platform, hardware.DeviceName,
		strings.Join(libraries, ", "))
	server, err := executor.GetServerInfo(callCtx, &pb.GetServerInfoRequest{})
	if err != nil {
		return err
	}
	fmt.Printf("server: specdec %s, torch %s, grpc %s, max batch %d, max queued %d\n", server.ServerVersion,
		server.TorchVersion, server.GrpcVersion, server.MaxBatchSize, server.MaxQueuedRequests)

	draft := draftModel(opts.method, int32(opts.numSpeculativeTokens))
	selection, err := selector.SelectBackends(callCtx, &pb.SelectBackendsRequest{
		Hardware:     hardware,
		TargetLayers: layerSpec(tinyLlama),
		Attention:    &pb.AttentionConfig{Backend: opts.targetBackend},
		Speculative: &pb.SpeculativeConfig{
			Method:               draft.Method,
			NumSpeculativeTokens: draft.NumSpeculativeTokens,
			AttentionBackend:     opts.drafterBackend,
			DraftLayers:          layerSpec(draft.Source.GetSynthetic()),
			DflashConfig:         draft.DflashConfig,
		},
	})
	if err != nil {
		return err
	}
	fmt.Printf("selector %s decided:\n", opts.selector)
	printDecision("target", selection.Target)
	printDecision("drafter", selection.Drafter)

	// Load with the selector's choices named explicitly: the executor validates them and never falls back.
	draft.AttentionBackend = selection.Drafter.Backend
	target, what := &pb.ModelSource{Source: &pb.ModelSource_Synthetic{Synthetic: tinyLlama}}, "a synthetic llama target"
	if opts.targetPath != "" {
		target, what = &pb.ModelSource{Source: &pb.ModelSource_Path{Path: opts.targetPath}}, opts.targetPath
	}
	load := &pb.LoadModelRequest{
		Target:      target,
		Draft:       draft,
		Dtype:       pb.DType_DTYPE_FLOAT32,
		Attention:   &pb.AttentionConfig{Backend: selection.Target.Backend},
		BlockSize:   blockSize,
		NumKvBlocks: 64,
	}
	fmt.Printf("loading %s and a %s drafter ...\n", what, opts.method)
	started := time.Now()
	loadCtx, cancelLoad := context.WithTimeout(ctx, loadTimeout)
	defer cancelLoad()
	loaded, err := executor.LoadModel(loadCtx, load)
	if err != nil {
		return err
	}
	fmt.Printf("loaded in %.2f s: target %s, drafter %s, %d KV blocks of %d tokens\n",
		time.Since(started).Seconds(), loaded.TargetBackend.Backend, loaded.DraftBackend.Backend,
		loaded.Info.NumKvBlocks, loaded.Info.BlockSize)

	request := &pb.GenerateRequest{
		RequestId: fmt.Sprintf("go-client-%d", os.Getpid()),
		Sampling:  &pb.SamplingParams{Temperature: 0, MaxTokens: proto.Int32(int32(opts.maxTokens)), Stop: opts.stop},
	}
	if opts.chat != "" { // the server renders it with the model's chat template
		messages := &pb.ChatMessages{Messages: []*pb.ChatMessage{{Role: "user", Content: opts.chat}}}
		request.Input = &pb.GenerateRequest_Messages{Messages: messages}
		fmt.Printf("generating up to %d tokens after the chat message %s:\n", opts.maxTokens, quote(opts.chat))
	} else {
		var prompt []int32
		for _, word := range strings.Fields(opts.prompt) {
			id, err := strconv.Atoi(word)
			if err != nil {
				return fmt.Errorf("--prompt takes token ids: %w", err)
			}
			prompt = append(prompt, int32(id))
		}
		request.Input = &pb.GenerateRequest_TokenIds{TokenIds: &pb.TokenIds{Ids: prompt}}
		fmt.Printf("generating up to %d tokens after the prompt %s:\n", opts.maxTokens, joinTokens(prompt))
	}
	stream, err := executor.Generate(ctx, request) // server streaming
	if err != nil {
		return err
	}
	var finished *pb.Finished
	var text strings.Builder // empty without a tokenizer
	for {
		response, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return err
		}
		if len(response.TokenIds) > 0 {
			fmt.Printf("  + %s (drafted %d, accepted %d)\n", joinTokens(response.TokenIds), response.NumDrafted,
				response.NumAccepted)
		}
		text.WriteString(response.Text)
		if response.Finished != nil {
			finished = response.Finished
		}
	}
	if finished == nil {
		return errors.New("the stream ended without a final message")
	}
	if text.Len() > 0 {
		fmt.Printf("text: %s\n", quote(text.String()))
	}
	printStatistics(finished)
	for number := 2; number <= opts.requests; number++ { // the same request again: round_robin picks the next replica
		request.RequestId = fmt.Sprintf("go-client-%d-%d", os.Getpid(), number)
		tokens, reason, err := generateQuietly(ctx, executor, request)
		if err != nil {
			return err
		}
		fmt.Printf("request %d of %d: %d tokens, %s\n", number, opts.requests, tokens, reason)
	}
	loadsCtx, cancelLoads := context.WithTimeout(ctx, callTimeout)
	defer cancelLoads()
	loads, err := executor.GetLoads(loadsCtx, &pb.GetLoadsRequest{})
	if err != nil {
		return err
	}
	fmt.Printf("loads: %d running, %d queued, %d/%d KV blocks used, %d prompt and %d generated tokens in all, "+
		"%.1f tokens/s\n", loads.RunningRequests, loads.QueuedRequests, loads.UsedKvBlocks, loads.NumKvBlocks,
		loads.PromptTokensTotal, loads.GenerationTokensTotal, loads.GenerationTokensPerSecond)
	return nil
}

// connect waits for the connection (a refused address fails at its first TransientFailure, not at a deadline), then
// checks that the `role` service answers there; its error names the address, the flag and the cause.
func connect(ctx context.Context, conn *grpc.ClientConn, role, address string) error {
	flagName := fmt.Sprintf("-%s / $SPECDEC_%s", role, strings.ToUpper(role))
	health := healthpb.NewHealthClient(conn)
	check := func(service string) error {
		checkCtx, cancel := context.WithTimeout(ctx, callTimeout)
		defer cancel()
		_, err := health.Check(checkCtx, &healthpb.HealthCheckRequest{Service: service}, grpc.WaitForReady(false))
		return err
	}
	waitCtx, cancel := context.WithTimeout(ctx, connectTimeout)
	defer cancel()
	state := conn.GetState() // grpc-go 1.33 dials at once: a new channel is never idle
	for state != connectivity.Ready && state != connectivity.TransientFailure && conn.WaitForStateChange(waitCtx, state) {
		state = conn.GetState()
	}
	if state != connectivity.Ready {
		cause := "it did not connect in time"
		if err := check(services[role]); err != nil { // without waiting: its UNAVAILABLE says why
			s, _ := status.FromError(err)
			cause = upperSnake(s.Code().String()) + ": " + s.Message()
		}
		return fmt.Errorf("cannot reach the %s at %s (%s): %s", role, address, flagName, cause)
	}
	if status.Code(check(services[role])) != codes.NotFound {
		return nil
	}
	var others []string
	for _, other := range []string{"executor", "selector"} {
		if check(services[other]) == nil {
			others = append(others, fmt.Sprintf("%s (a specdec %s)", services[other], other))
		}
	}
	there := strings.Join(others, " and ")
	if there == "" {
		there = "neither specdec service"
	}
	return fmt.Errorf("the %s at %s (%s) is not a specdec %s: its health service names %s there, not %s",
		role, address, flagName, role, there, services[role])
}

// checkAddress refuses HOST:PORT with a port outside 1..65535; other gRPC targets (dns:///NAME:PORT, unix:PATH)
// pass as they are.
func checkAddress(role, address string) error {
	colon := strings.LastIndex(address, ":")
	if colon <= 0 || address[colon-1] == ':' {
		return nil
	}
	port, err := strconv.Atoi(address[colon+1:])
	if err != nil || (port >= 1 && port <= 65535) {
		return nil
	}
	return fmt.Errorf("-%s %q: %d is not a port in 1..65535", role, address, port)
}

// dialTarget: grpc-go resolves dns:///NAME:PORT itself (every address of the name, which round_robin spreads
// over). The ipv4:/ipv6: address lists that gRPC C-core and grpc-js accept get a static resolver of those addresses.
func dialTarget(target string) (string, []grpc.DialOption) {
	scheme, list, found := strings.Cut(target, ":")
	if !found || (scheme != "ipv4" && scheme != "ipv6") {
		return target, nil
	}
	var addresses []resolver.Address
	for _, address := range strings.Split(list, ",") {
		if address != "" {
			addresses = append(addresses, resolver.Address{Addr: address})
		}
	}
	static := manual.NewBuilderWithScheme("static")
	static.InitialState(resolver.State{Addresses: addresses})
	return "static:///" + list, []grpc.DialOption{grpc.WithResolvers(static)}
}

// generateQuietly streams one generation and returns its token count and finish reason.
func generateQuietly(ctx context.Context, executor pb.ExecutorClient, request *pb.GenerateRequest) (int, string, error) {
	stream, err := executor.Generate(ctx, request)
	if err != nil {
		return 0, "", err
	}
	tokens, reason := 0, ""
	for {
		response, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return tokens, reason, nil
		}
		if err != nil {
			return 0, "", err
		}
		tokens += len(response.TokenIds)
		if response.Finished != nil {
			reason = response.Finished.FinishReason
		}
	}
}

// quote writes a text as a JSON string, as the Python and Node.js clients do.
func quote(text string) string {
	quoted, _ := json.Marshal(text) // a Go string always encodes
	return string(quoted)
}

// upperSnake spells a status code as the gRPC spec does: InvalidArgument -> INVALID_ARGUMENT.
func upperSnake(name string) string {
	var out strings.Builder
	for i, r := range name {
		if i > 0 && unicode.IsUpper(r) && unicode.IsLower(rune(name[i-1])) {
			out.WriteByte('_')
		}
		out.WriteRune(unicode.ToUpper(r))
	}
	return out.String()
}

func main() {
	var opts options
	flag.StringVar(&opts.selector, "selector", envOr("SPECDEC_SELECTOR", "127.0.0.1:50051"), "selector HOST:PORT")
	flag.StringVar(&opts.executor, "executor", envOr("SPECDEC_EXECUTOR", "127.0.0.1:50052"), "executor HOST:PORT")
	flag.StringVar(&opts.method, "method", "dflash", "the drafter's kind: dflash | eagle3")
	flag.IntVar(&opts.numSpeculativeTokens, "num-speculative-tokens", 4, "tokens drafted per step")
	flag.StringVar(&opts.targetBackend, "target-backend", "auto", `"auto" or a backend name, e.g. CPU_ATTN`)
	flag.StringVar(&opts.drafterBackend, "drafter-backend", "auto", "the drafter's own; never inherited")
	flag.IntVar(&opts.maxTokens, "max-tokens", 24, "tokens to generate at most")
	flag.StringVar(&opts.prompt, "prompt", "1 2 3 4 5", "token ids, separated by spaces")
	flag.StringVar(&opts.targetPath, "target-path", "", "a checkpoint under the executor's --model-root to load "+
		"instead of the synthetic target (a Llama of the same shape, e.g. one with a tokenizer and a chat template)")
	flag.StringVar(&opts.chat, "chat", "", "send this user message, in the model's chat template, instead of -prompt")
	flag.Var(&opts.stop, "stop", "a stop string (repeatable); needs a tokenizer")
	flag.IntVar(&opts.requests, "requests", 1, "send the generation this many times (replicas: spread over them)")
	flag.Parse()
	if flag.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "unexpected argument %q: this command takes flags only\n", flag.Arg(0))
		flag.Usage()
		os.Exit(2)
	}
	if opts.requests < 1 {
		fmt.Fprintln(os.Stderr, "-requests must be at least 1")
		os.Exit(2)
	}
	for _, role := range []string{"executor", "selector"} {
		address := map[string]string{"executor": opts.executor, "selector": opts.selector}[role]
		if err := checkAddress(role, address); err != nil {
			fmt.Fprintln(os.Stderr, err)
			flag.Usage()
			os.Exit(2)
		}
	}
	if _, ok := methods[opts.method]; !ok {
		fmt.Fprintln(os.Stderr, "-method must be dflash or eagle3")
		os.Exit(2)
	}

	ctx := context.Background()
	if token := os.Getenv("SPECDEC_AUTH_TOKEN"); token != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token)
	}
	if err := run(ctx, opts); err != nil {
		if s, ok := status.FromError(err); ok {
			fmt.Fprintf(os.Stderr, "error: %s: %s\n", upperSnake(s.Code().String()), s.Message())
		} else {
			fmt.Fprintf(os.Stderr, "error: %v\n", err)
		}
		os.Exit(1)
	}
}
